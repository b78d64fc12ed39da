"""A comparison file's names become folders: each is checked before anything runs."""

from __future__ import annotations

import pytest

from sim.compare import load_comparison
from sim.errors import InputError
from tests.test_cli import COMPARISON


@pytest.mark.parametrize(("before", "after", "needle"), [
    ("  colocated: {", "  a/b: {", "variants='a/b': a variant's name is its results' folder"),
    ("  colocated: {", "  '..': {", "variants='..': a variant's name"),
    ("name: cmp", "name: 5", "name=5: must be text"),
    ("name: cmp", "name: /abs", "name='/abs': names the directory results/<name>"),
    ("colocated: {cluster", "colocated: {name: mine, cluster",
     "variants.colocated.name='mine': a variant is named cmp/colocated by the comparison"),
])
def test_names_that_would_misplace_results_are_refused(tmp_path, before, after, needle):
    path = tmp_path / "cmp.yaml"
    path.write_text(COMPARISON.replace(before, after, 1))
    with pytest.raises(InputError) as exc:
        load_comparison(path)
    assert needle in exc.value.one_line()


def test_the_shipped_layout_still_loads(tmp_path):
    path = tmp_path / "cmp.yaml"
    path.write_text(COMPARISON)
    assert list(load_comparison(path)) == ["colocated", "first", "split"]
    assert load_comparison(path)["first"].name == "cmp/first"
