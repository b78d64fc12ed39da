"""A comparison file's names become folders: each is checked before anything runs."""

from __future__ import annotations

import pytest

from sim.config.errors import InputError
from sim.studies.compare import load_comparison
from tests.cli.test_cli import COMPARISON


@pytest.mark.parametrize(("before", "after", "needle"), [
    ("  colocated: {", "  a/b: {", "variants='a/b': a variant's name is its results' folder"),
    ("  colocated: {", "  '..': {", "variants='..': a variant's name"),
    # The comparison's own files and folders beside its variants: a variant named so would
    # collide (comparison.csv: a traceback once every variant had run; plots: figures drawn
    # into its run).
    ("  colocated: {", "  comparison.csv: {", "variants='comparison.csv': the comparison's own"),
    ("  colocated: {", "  comparison_replications.csv: {", "the comparison's own"),
    ("  colocated: {", "  comparison_differences.csv: {", "the comparison's own"),
    ("  colocated: {", "  plots: {", "variants='plots': the comparison's own"),
    ("  colocated: {", "  report.html: {", "variants='report.html': the comparison's own"),
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


def test_the_base_may_be_a_scenario_file_as_a_sweeps_is(tmp_path):
    """A sweep file's `base:` took a file and a comparison's only a mapping (found by a
    walk-through): both now take either, a file's relative paths read from its own folder."""
    import yaml

    inline = tmp_path / "inline.yaml"
    inline.write_text(COMPARISON)
    data = yaml.safe_load(COMPARISON)
    (tmp_path / "scenarios").mkdir()
    lengths = tmp_path / "scenarios" / "lengths.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n2000,60\n")
    base = {**data["base"], "workload": {**data["base"]["workload"],
                                         "lengths": {"file": "lengths.csv"}}}
    (tmp_path / "scenarios" / "base.yaml").write_text(yaml.safe_dump(base))
    from_file = tmp_path / "from_file.yaml"
    from_file.write_text(yaml.safe_dump({**data, "base": "scenarios/base.yaml"}))
    loaded = load_comparison(from_file)
    assert list(loaded) == ["colocated", "first", "split"]
    assert loaded["first"].workload.lengths.file == lengths  # its own folder's file
    assert loaded["first"].replica.scheduler.name == "prefill_first"
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({**data, "base": "nowhere.yaml"}))
    with pytest.raises(InputError) as exc:
        load_comparison(missing)
    assert "nowhere.yaml" in exc.value.one_line()
