"""Bad scenario, sweep and comparison files, `--set` values, seeds and output directories: one
line each, exit code 2, never a traceback, never a silently wrong run (found by fuzzing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.errors import InputError
from sim.overrides import parse_override
from sim.yaml_input import read_yaml
from tests.conftest import assert_one_line_error, run_cli

SCENARIO = """name: tiny
seed: 0
workload:
  format: synthetic
  num_requests: 20
  arrivals: {process: poisson, qps: 5}
  lengths: {prompt: {dist: fixed, value: 100}, output: {dist: fixed, value: 10}}
replica:
  model: llama-3.1-8b
  latency: {kind: constant, iteration_s: 0.01}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- YAML --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "needles"), [
    ("a: " + "[" * 1000 + "]" * 1000 + "\n", ["<yaml>", "nested too deeply"]),
    ("a: " + "{b: " * 1000 + "1" + "}" * 1000 + "\n", ["<yaml>", "nested too deeply"]),
    ("a: " + "[" * 100 + "]" * 100 + "\n", ["<yaml>", "nested too deeply (at most 64)"]),
    ("seed: 1" + "0" * 5000 + "\n", ["seed (line 1)", "an integer of 5001 digits"]),
    ("w:\n  - 0x" + "f" * 40 + "\n", ["w.0 (line 2)", "an integer of 40 digits"]),
    ("1: a\n'1': b\n", ["1 (line 1)", "a key must be text", "a number", "quote it ('1')"]),
    ("v:\n  true: {}\n", ["v.true (line 2)", "as a boolean"]),
    ("grid:\n  null: [2]\n", ["grid.null (line 2)", "as none"]),
    ("? [a]\n: 1\n", ["? (line 1)", "not a list or mapping"]),
])
def test_yaml_that_cannot_be_read_as_meant_is_one_line(tmp_path, text, needles):
    path = write(tmp_path, "s.yaml", text)
    with pytest.raises(InputError) as info:
        read_yaml(path)
    line = info.value.one_line()
    assert line.startswith(str(path)) and "\n" not in line
    for needle in needles:
        assert needle in line, (needle, line)


def test_merge_keys_and_quoted_keys_still_read(tmp_path):
    path = write(tmp_path, "s.yaml", "a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n'1': x\n")
    assert read_yaml(path) == {"a": {"b": 1}, "c": {"b": 1, "d": 2}, "1": "x"}


@pytest.mark.parametrize("name", ["a" * 300 + ".yaml", "/".join(["b" * 200] * 25) + ".yaml"])
def test_an_over_long_scenario_path_is_one_line(tmp_path, monkeypatch, capsys, name):
    code, err = run_cli(monkeypatch, capsys, "simulate", f"{tmp_path}/{name}")
    assert_one_line_error(code, err, "<file>", "File name too long")


def test_a_huge_scenario_file_is_refused_unread(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "big.yaml", "name: x\n# " + "a" * 11_000_000 + "\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, "big.yaml", "too large")


@pytest.mark.parametrize(("value", "problem"), [
    ("seed=" + "9" * 100_000, "VALUE: an integer of 100000 digits"),
    ("seed=" + "[" * 1000 + "]" * 1000, "VALUE: nested too deeply"),
    ("workload.arrivals={true: 1}", "VALUE: a key must be text"),
])
def test_set_values_that_cannot_be_read_as_meant(value, problem):
    with pytest.raises(InputError) as info:
        parse_override(value)
    assert info.value.field == "--set" and problem in info.value.one_line()
