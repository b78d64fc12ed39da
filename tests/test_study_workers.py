"""One error path for sweep runs, wherever they run: an input problem met by a run is one line
and exit 2 (local worker processes and Ray), a missing input is found before any run, and any
other failure in a worker ends the sweep at once instead of breaking or hanging the pool."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sim.sweep import load_sweep, run_sweep
from sim.sweep_workers import SweepCrashed
from tests.conftest import assert_one_line_error, run_cli

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


def leftovers(out: Path) -> list[str]:
    """Anything in runs/ that is not a whole run directory (temporary directories included)."""
    runs = out / "runs"
    return [p.name for p in runs.iterdir()
            if not ((p / "summary.json").is_file() and (p / "inputs.json").is_file())]


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_input_error_in_a_worker_is_one_line(tmp_path, monkeypatch, capsys, backend):
    if backend == "ray":
        pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'servesim[ray]'")
    sweep = make_sweep(tmp_path, ["good.csv", "bad.csv"])
    out = tmp_path / "out"
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep), "--out", str(out),
                        "--workers", "2", "--backend", backend)
    assert_one_line_error(code, err, "bad.csv", "num_prefill_tokens", "missing")
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
    start = time.monotonic()
    with pytest.raises(SweepCrashed, match="Unpicklable"):
        run_sweep(runs, tmp_path / "out", workers=2)
    assert time.monotonic() - start < 30
    assert leftovers(tmp_path / "out") == []
