"""One error path for sweep runs, wherever they run: an input problem met by a run is one line
and exit 2 (local worker processes and Ray), a missing input is found before any run, and any
other failure in a worker ends the sweep at once instead of breaking or hanging the pool."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim.cli import main
from sim.studies.sweep import run_sweep
from sim.studies.sweep_file import load_sweep
from sim.studies.workers import SweepCrashed
from tests.helpers import assert_one_line_error, run_cli, within

LENGTHS = """
name: lf
workload:
  format: synthetic
  num_requests: 60
  arrivals: {qps: 5}
  lengths: {file: good.csv}
replica:
  latency: {kind: constant, iteration_s: 0.01}
"""


def make_sweep(tmp_path: Path, files: list[str], qps: tuple[int, ...] = (1, 2, 3)) -> Path:
    """A sweep over length files (good.csv is valid, bad.csv lacks the columns) and rates."""
    (tmp_path / "good.csv").write_text("num_prefill_tokens,num_decode_tokens\n100,20\n"
                                       "300,5\n")
    (tmp_path / "bad.csv").write_text("foo,bar\n1,2\n")
    (tmp_path / "base.yaml").write_text(LENGTHS)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: lf\nbase: base.yaml\ngrid:\n  workload.lengths.file: {files}\n"
                     f"  workload.arrivals.qps: {list(qps)}\n")
    return sweep


# The line a sweep logs every 10 s when stderr is not a terminal (`sim.studies.progress`). A short
# sweep prints none, but on a loaded machine (Ray starting on two busy cores) it runs that long, and
# one such line came before the error: the error itself is still one line.
PROGRESS = re.compile(r"sweep \S+: progress \d+/\d+ runs, \d+ s")


def without_progress(err: str) -> str:
    return "".join(line for line in err.splitlines(keepends=True)
                   if not PROGRESS.fullmatch(line.strip()))


def leftovers(out: Path) -> list[str]:
    """Anything in runs/ that is not a whole run directory (temporary directories included)."""
    runs = out / "runs"
    return [p.name for p in runs.iterdir()
            if not ((p / "summary.json").is_file() and (p / "inputs.json").is_file())]


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_input_error_in_a_worker_is_one_line(tmp_path, monkeypatch, capsys, backend):
    if backend == "ray":
        pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'servesim[ray]'")
    sweep = make_sweep(tmp_path, ["good.csv", "bad.csv"])
    out = tmp_path / "out"
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(out),
                        "--workers", "2", "--backend", backend)
    assert_one_line_error(code, without_progress(err), "bad.csv", "num_prefill_tokens",
                          "missing")
    assert leftovers(out) == []
    assert not (out / "results.parquet").exists()  # no table from a partial set


def test_missing_input_is_found_before_any_run(tmp_path, monkeypatch, capsys):
    sweep = make_sweep(tmp_path, ["good.csv", "gone.csv"])
    out = tmp_path / "out"
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(out))
    assert_one_line_error(code, err, "gone.csv", "file not found")
    assert not out.exists()


class Unpicklable(Exception):
    """Its constructor takes two arguments: unpickling it fails (the classic trap)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} {b}")


def test_other_worker_failures_end_the_sweep_without_hanging(tmp_path, monkeypatch):
    import sim.runner

    real = sim.runner.run_scenario

    def flaky(scenario, **kwargs):
        if scenario.workload.arrivals.qps == 2:
            raise Unpicklable(1, 2)
        return real(scenario, **kwargs)

    # Worker processes are forked after this, so they run `flaky` too.
    monkeypatch.setattr(sim.runner, "run_scenario", flaky)
    _, runs = load_sweep(make_sweep(tmp_path, ["good.csv"], qps=(1, 2, 3, 4)))
    with within(120), pytest.raises(SweepCrashed, match="Unpicklable"):  # a hang guard
        run_sweep(runs, tmp_path / "out", workers=2)
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("backend,workers", [("local", "1"), ("local", "2"), ("ray", "2")])
def test_a_failed_sweep_leaves_the_earlier_results_or_an_unfinished_sweep(
        tmp_path, monkeypatch, capsys, backend, workers):
    """`SweepFailed` at the command line: one line, exit 2. An input found unreadable before any
    run (keying the points) leaves the earlier sweep exactly as it was; one met by a run leaves
    the earlier runs whole and unchanged and no table from the earlier sweep beside the new
    one's runs (the sweep reads as unfinished). Once the input is mended the sweep resumes,
    running only what is missing."""
    if backend == "ray":
        pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'servesim[ray]'")
    sweep = make_sweep(tmp_path, ["good.csv"], qps=(1, 2))
    sweep.write_text(sweep.read_text() + "seeds: [0, 1]\n")
    out = tmp_path / "out"

    def sweep_with(files: list[str]) -> tuple[int, str]:
        """Exit code (0: it returned) and stderr of the sweep over these length files."""
        sweep.write_text(re.sub(r"file: \[.*\]", f"file: {files}", sweep.read_text()))
        monkeypatch.setattr(sys, "argv", ["servesim", "sweep", str(sweep), "--out", str(out),
                                          "--workers", workers, "--backend", backend])
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        return code, without_progress(capsys.readouterr().err)

    assert sweep_with(["good.csv"])[0] == 0
    tables = ["results.parquet", "results.csv", "results_ci.parquet", "results_ci.csv"]
    assert all((out / name).is_file() for name in tables)
    earlier = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    assert_one_line_error(*sweep_with(["good.csv", "gone.csv"]), "gone.csv", "file not found")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == earlier

    assert_one_line_error(*sweep_with(["good.csv", "bad.csv"]), "bad.csv",
                          "num_prefill_tokens", "missing")
    assert leftovers(out) == []  # whole runs only: no temporary or partial directory
    runs = {p: data for p, data in earlier.items() if p.parent.parent.name == "runs"}
    assert {p: p.read_bytes() for p in runs} == runs
    assert not [name for name in tables if (out / name).exists()]
    assert_one_line_error(*run_cli(monkeypatch, capsys, "plot", str(out)), "results.parquet",
                          "the sweep has not finished")

    (tmp_path / "bad.csv").write_text("num_prefill_tokens,num_decode_tokens\n10,2\n")
    assert sweep_with(["good.csv", "bad.csv"])[0] == 0
    assert len(pd.read_parquet(out / "results.parquet")) == 8
    assert {p: p.read_bytes() for p in runs} == runs  # not run again
