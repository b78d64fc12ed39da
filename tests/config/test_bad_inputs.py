"""Bad scenario, sweep and comparison files, `--set` values, seeds and output directories: one
line each, exit code 2, never a traceback, never a silently wrong run (found by fuzzing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sim.config.errors import InputError
from sim.config.overrides import parse_override
from sim.config.yaml_input import read_yaml
from tests.helpers import assert_one_line_error, run_cli, run_cli_out

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


# YAML 1.1 (PyYAML) reads these as numbers nobody reading the file would see: 0100 is 64, 1:00:00
# is 3600. They were silently taken; "Numbers are strict" refuses them.
@pytest.mark.parametrize(("old", "new", "needles"), [
    ("num_requests: 20", "num_requests: 0100",
     ["workload.num_requests (line 5)=0100: YAML 1.1 reads 0100 as the octal number 64: write it "
      "in plain decimal"]),
    ("seed: 0", "seed: 010", ["seed (line 2)=010", "octal number 8"]),
    ("name: tiny", "name: tiny\nhorizon_s: 1:00:00", ["horizon_s (line 2)=1:00:00",
                                                     "base-60 number 3600"]),
    ("model: llama-3.1-8b", "model: llama-3.1-8b\n  scheduler: {name: chunked_prefill, "
     "token_budget: 0512}", ["replica.scheduler.token_budget (line 10)=0512",
                             "octal number 330"]),
    ("qps: 5", "qps: 1_0.5", ["workload.arrivals.qps (line 6)=1_0.5", "number 10.5"]),
    ("qps: 5", "qps: 0:30.5", ["workload.arrivals.qps (line 6)=0:30.5", "base-60 number 30.5"]),
    ("seed: 0", "seed: !!int abc", ["seed (line 2)=abc", "not one YAML reads"]),
    ("seed: 0", "seed: !!float abc", ["seed (line 2)=abc", "not one YAML reads"]),
])
def test_yaml_1_1_number_forms_in_a_scenario_are_one_line(tmp_path, monkeypatch, capsys, old,
                                                          new, needles):
    path = write(tmp_path, "s.yaml", SCENARIO.replace(old, new))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, str(path), *needles)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("value", "problem"), [
    ("062", "octal number 50"), ("0b110010", "binary number 50"),
    ("0x10", "hexadecimal number 16"), ("1_0", "number 10"), ("-0x10", "hexadecimal number -16"),
    ("00", "octal number 0"),
])
def test_yaml_1_1_number_forms_in_set_are_one_line(tmp_path, monkeypatch, capsys, value,
                                                   problem):
    path = write(tmp_path, "s.yaml", SCENARIO)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"),
                        "--set", f"workload.num_requests={value}")
    assert_one_line_error(code, err, f"--set='workload.num_requests={value}'",
                          f"VALUE: YAML 1.1 reads {value} as the {problem}: write it in plain "
                          "decimal")


def test_plain_numbers_still_read(tmp_path):
    # Every float form PyYAML's resolver takes without `_` or `:` (1e3, with no '.' and no
    # exponent sign, is text to YAML 1.1 and stays so); a quoted 0100 is text.
    path = write(tmp_path, "s.yaml", "a: [512, -1, 0, -0, +5, 1.5, 1.0e+3, 1.e-3, .5, 1., "
                                     "010.5, -2.5E+2, .inf, 1e3, '0100', !!float 1]\n")
    assert read_yaml(path) == {"a": [512, -1, 0, 0, 5, 1.5, 1000.0, 0.001, 0.5, 1.0, 10.5,
                                     -250.0, float("inf"), "1e3", "0100", 1.0]}
    assert parse_override("workload.num_requests=512") == ("workload.num_requests", 512)
    assert parse_override("workload.arrivals.qps=.5") == ("workload.arrivals.qps", 0.5)


# -- sweeps ------------------------------------------------------------------------------------

def sweep(tmp_path: Path, body: str, name: str = "name: sw\n") -> Path:
    write(tmp_path, "base.yaml", SCENARIO)
    return write(tmp_path, "sweep.yaml", f"{name}base: base.yaml\n{body}")


@pytest.mark.parametrize(("body", "needles"), [
    ("grid:\n  123: [2]\n", ["grid.123 (line 4)", "a key must be text"]),
    ("grid:\n  '123': [2]\n", ["grid.123", "must be a field's path"]),
    ("grid:\n  seed: [1, 2]\n", ["grid.seed", "listed in `seeds:`"]),
    ("grid:\n  workload.arrivals.qps: [2, 3]\nzip:\n  workload.arrivals.qps: [7]\n",
     ["zip.workload.arrivals.qps", "grid.workload.arrivals.qps sweeps the same field"]),
    ("grid:\n  workload.arrivals: [{process: poisson, qps: 2}]\n"
     "  workload.arrivals.qps: [3, 4]\n",
     ["grid.workload.arrivals.qps", "grid.workload.arrivals sweeps a field inside"]),
    ("grid:\n  workload.arrivals.qps: [2, 2.0]\n", ["grid.workload.arrivals.qps=2.0",
                                                   "listed twice"]),
    ("zip:\n  name: [a, a]\n", ["zip.name='a'", "listed twice"]),
    ("seeds: [1, 1]\n", ["seeds=1", "listed twice"]),
    ("grid:\n  workload.num_requests: [10, 0100]\n",
     ["grid.workload.num_requests.1 (line 4)=0100", "octal number 64"]),
    ("seeds: [9223372036854775808]\n", ["seeds=", "2**63 - 1"]),
    ("grid:\n" + "".join(f"  replica.scheduler.x{i}: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n"
                         for i in range(10)),
     ["grid=", "= 10,000,000,000 runs", "at most 10,000 runs"]),
    ("seeds: [" + ", ".join(map(str, range(1000))) + "]\n"
     "grid:\n  workload.arrivals.qps: [" + ", ".join(str(1 + i) for i in range(11)) + "]\n",
     ["11 x 1 x 1000 = 11,000 runs"]),
])
def test_bad_sweeps_are_one_line(tmp_path, monkeypatch, capsys, body, needles):
    path = sweep(tmp_path, body)
    code, err = run_cli(monkeypatch, capsys, "sweep", str(path), "--workers", "1",
                        "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, str(path), *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("name", "needles"), [
    ("name: /tmp/escaped\n", ["name='/tmp/escaped'", "results/<name>"]),
    ("name: ../../escaped\n", ["name='../../escaped'"]),
    ("name: true\n", ["name=True", "must be text"]),
    ("name: {a: 1}\n", ["name={'a': 1}", "must be text"]),
])
def test_a_sweep_name_never_leaves_results(tmp_path, monkeypatch, capsys, name, needles):
    path = sweep(tmp_path, "", name)
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(monkeypatch, capsys, "sweep", str(path), "--workers", "1")
    assert_one_line_error(code, err, str(path), *needles)
    assert not (tmp_path / "results").exists()


def test_a_sweep_without_seeds_keeps_the_base_seed(tmp_path):
    from sim.studies.sweep_file import load_sweep

    path = sweep(tmp_path, "grid:\n  workload.arrivals.qps: [2, 3]\n")
    _, runs = load_sweep(path)
    assert [r.seed for r in runs] == [0, 0] and [r.scenario.seed for r in runs] == [0, 0]


# -- seeds and replications --------------------------------------------------------------------

def comparison(tmp_path: Path) -> Path:
    base = "".join(f"  {line}\n" for line in SCENARIO.splitlines()[1:])
    return write(tmp_path, "cmp.yaml", f"name: c\nbase:\n{base}variants:\n  a: {{}}\n")


@pytest.mark.parametrize(("args", "needles"), [
    (["--seed", str(2**63)], ["<command line>: --seed=9223372036854775808", "2**63 - 1"]),
    (["--seed", str(2**64)], ["--seed=18446744073709551616"]),
    (["--set", f"seed={2**63}"], ["--set seed=9223372036854775808", "less than or equal"]),
    (["--seed", str(2**63 - 1), "--replications", "2"],
     ["--replications=2", "seeds 9223372036854775807..9223372036854775808 pass"]),
    (["--replications", "100000000000"], ["--replications=100000000000", "at most 1,000"]),
])
def test_seeds_and_replications_are_bounded_at_input(tmp_path, monkeypatch, capsys, args,
                                                     needles):
    path = write(tmp_path, "s.yaml", SCENARIO)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), *args,
                        "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["compare", "capacity"])
def test_compare_and_capacity_bound_replications(tmp_path, monkeypatch, capsys, command):
    target = (str(comparison(tmp_path)) if command == "compare"
              else str(write(tmp_path, "s.yaml", SCENARIO)))
    slo = ["--tbt-p99", "0.5"] if command == "capacity" else []
    code, err = run_cli(monkeypatch, capsys, command, target, *slo, "--replications",
                        "100000000000", "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "--replications=100000000000", "at most 1,000")


# -- output directories ------------------------------------------------------------------------

def command_args(tmp_path: Path, command: str) -> list[str]:
    """A quick valid invocation of `command`, without --out."""
    scenario = str(write(tmp_path, "s.yaml", SCENARIO))
    if command == "compare":
        return ["compare", str(comparison(tmp_path))]
    if command == "sweep":
        return ["sweep", str(sweep(tmp_path, "grid:\n  workload.arrivals.qps: [2]\n")),
                "--workers", "1"]
    if command == "capacity":
        return ["capacity", scenario, "--tbt-p99", "0.5", "--replications", "1"]
    return ["simulate", scenario]


COMMANDS = ["simulate", "compare", "sweep", "capacity"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("out", ["c" * 300, "/".join(["d" * 200] * 25)])
def test_an_over_long_out_is_one_line(tmp_path, monkeypatch, capsys, command, out):
    code, err = run_cli(monkeypatch, capsys, *command_args(tmp_path, command),
                        "--out", str(tmp_path / out))
    assert_one_line_error(code, err, "--out=", "File name too long")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_dangling_symlink_out_is_refused_before_the_run(tmp_path, monkeypatch, capsys,
                                                          command):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere" / "zz")
    code, err = run_cli(monkeypatch, capsys, *command_args(tmp_path, command),
                        "--out", str(link))
    assert_one_line_error(code, err, "--out=", "a symbolic link to", "does not exist")


@pytest.mark.parametrize("command", COMMANDS)
def test_an_out_holding_a_newline_stays_on_one_line(tmp_path, monkeypatch, capsys, command):
    out = tmp_path / "new\nline"
    out.mkdir()
    (out / "keep.txt").write_text("x")  # not results: refused
    code, err = run_cli(monkeypatch, capsys, *command_args(tmp_path, command),
                        "--out", str(out))
    assert_one_line_error(code, err, repr(str(out)))
    assert (out / "keep.txt").read_text() == "x"


def test_export_bounds_num_flows(tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "export", str(tmp_path), "--format", "chrome",
                        "--num-flows", "99999999999", "--out", str(tmp_path / "t.json"))
    assert_one_line_error(code, err, "--num-flows=99999999999", "at most 10,000,000")


# -- capacity ----------------------------------------------------------------------------------

def test_an_unattainable_slo_is_an_answer_not_an_error_on_a_rate_never_given(
        tmp_path, monkeypatch, capsys):
    """Halving the rate until a run cannot be simulated used to end in an error blaming that
    rate (workload.arrivals.qps=9.3e-09), which the user never wrote. Now the halving stops
    once load no longer changes the latency (the target is below an unloaded server's)."""
    import json

    path = write(tmp_path, "s.yaml", SCENARIO)
    code, out = run_cli_out(monkeypatch, capsys, "capacity", str(path), "--ttft-p90", "1e-6",
                            "--replications", "1", "--precision", "0.3",
                            "--out", str(tmp_path / "out"))
    assert code == 0 and "no rate probed held" in out
    data = json.loads((tmp_path / "out" / "capacity.json").read_text())
    assert data["capacity_qps"] == 0.0 and data["interval_qps"][1] < 0.1
    meaning = data["interval_meaning"]
    assert "no rate probed held" in meaning and "the search stopped at" in meaning
    assert "below what an unloaded server gives" in meaning


def test_a_rate_that_cannot_be_simulated_ends_the_search_with_its_reason():
    """Where halving reaches a rate that cannot be simulated (arrivals spanning past 2**32 s),
    the search stops there and says why, rather than fail on a rate the user never gave."""
    import yaml

    from sim.config.scenario import parse_scenario
    from sim.runner import run_scenario
    from sim.studies.capacity import search
    from sim.studies.rate_decision import SLOTargets

    def run(scenario):  # type: ignore[no-untyped-def]
        qps = scenario.workload.arrivals.qps
        if qps < 3:  # a stand-in for the span check, reached sooner
            raise InputError(scenario.source, "workload.arrivals.qps", qps, "arrivals span long")
        return run_scenario(scenario)

    stopped: list[str] = []
    scenario = parse_scenario(yaml.safe_load(SCENARIO), "test")
    rates = search(scenario, SLOTargets(ttft_p90_s=1e-6), [0], deterministic=True, run=run,
                   stopped=stopped)
    assert [d.decision for d in rates] == ["fails"]
    assert len(stopped) == 1
    assert "cannot be simulated (workload.arrivals.qps: arrivals span long)" in stopped[0]


def test_capacity_refuses_a_starting_rate_above_the_highest(tmp_path, monkeypatch, capsys):
    """At qps 1e200 the search called every rate stable (arrival times 1e-200 s apart squared
    to zero in the overload test) and reported a capacity of at least 1.1e+212 req/s."""
    path = write(tmp_path, "s.yaml", SCENARIO)
    code, err = run_cli(monkeypatch, capsys, "capacity", str(path), "--tbt-p99", "0.04",
                        "--replications", "1", "--precision", "0.2",
                        "--set", "workload.arrivals.qps=1.0e+200",
                        "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "--set workload.arrivals.qps=1e+200",
                          "faster than 1e+09 req/s")


@pytest.mark.parametrize("workload,start", [
    ("", "workload.arrivals.qps=3.0e+8"),
    # A trace's knob is its rate scale: the highest is 1e9 over the trace's rate (19 arrivals
    # in 5.9 s), rounded down so that the probe is not refused.
    ("workload: {format: vidur, path: v.csv}\n", "workload.rate_scale=1.0e+8"),
])
def test_capacity_doubling_stops_at_the_highest_rate_and_says_so(tmp_path, monkeypatch, capsys,
                                                                 workload, start):
    """Targets met at any rate: doubling used to go on for 40 steps (to 3e+20 req/s from
    3e+8). It probes the highest rate simulated, 1e9 req/s, last, and says it stopped there."""
    import json

    text = SCENARIO
    if workload:
        gaps = np.random.default_rng(11).exponential(0.3, 19)
        times = np.concatenate([[0.0], np.cumsum(gaps)])  # 1e9 / rate * rate > 1e9 here
        write(tmp_path, "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n"
              + "".join(f"{t:.6f},100,10\n" for t in times))
        text = text[:text.index("workload:")] + workload + text[text.index("replica:"):]
    path = write(tmp_path, "s.yaml", text)
    code, out = run_cli_out(monkeypatch, capsys, "capacity", str(path), "--tbt-p99", "1",
                            "--replications", "1", "--precision", "0.3", "--set", start,
                            "--out", str(tmp_path / "out"))
    assert code == 0
    data = json.loads((tmp_path / "out" / "capacity.json").read_text())
    assert data["interval_qps"][1] is None
    assert data["interval_qps"][0] == pytest.approx(1e9, rel=1e-9)
    assert data["interval_qps"][0] <= 1e9
    assert max(r["qps"] for r in data["rates"]) <= 1e9 and len(data["rates"]) <= 5
    assert "the search stopped at 1e+09 req/s, the highest arrival rate simulated" in (
        data["interval_meaning"])
    assert "cannot be simulated" not in data["interval_meaning"]
    assert "the highest arrival rate" in " ".join(out.split())


def test_export_refuses_a_percentile_given_twice(tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "export", str(tmp_path), "--format", "vllm",
                        "--percentiles", "50,99,50.0", "--out", str(tmp_path / "r.json"))
    assert_one_line_error(code, err, "--percentiles='50,99,50.0'", "50.0 is given twice")


def test_a_comparison_named_with_a_slash_goes_to_results_of_that_name(tmp_path, monkeypatch,
                                                                       capsys):
    base = "".join(f"  {line}\n" for line in SCENARIO.splitlines()[1:])
    path = write(tmp_path, "cmp.yaml", f"name: x/y\nbase:\n{base}variants:\n  a: {{}}\n")
    monkeypatch.chdir(tmp_path)
    code, _ = run_cli_out(monkeypatch, capsys, "compare", str(path))
    assert code == 0
    assert (tmp_path / "results" / "x" / "y" / "a" / "summary.json").is_file()
    assert (tmp_path / "results" / "x" / "y" / "comparison.csv").is_file()
