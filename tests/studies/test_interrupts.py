"""Ctrl-C during `sweep`, `compare` and `capacity`, sent to a real `servesim` process: it stops
at once, exits 130, says what it kept, keeps only whole run directories and writes no table
from a partial set of runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import sigint_default

SCENARIO = """
name: slow
workload:
  format: synthetic
  num_requests: 3000
  arrivals: {qps: 5}
  lengths:
    prompt: {dist: uniform, low: 50, high: 1500}
    output: {dist: uniform, low: 5, high: 80}
replica:
  scheduler: {name: chunked_prefill, token_budget: 512}
  latency: {kind: constant, iteration_s: 0.02}
"""


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """`servesim ARGS` in its own process group (as a shell runs a foreground job)."""
    return subprocess.Popen([sys.executable, "-m", "sim", *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=sigint_default)


def interrupt_when(proc: subprocess.Popen[str], ready: Callable[[], bool], *,
                   group: bool = True, sig: int = signal.SIGINT) -> str:
    """Send SIGINT (to the process group, as Ctrl-C does, or to the main process only) once
    `ready()`; return the process's stderr. That it stopped at once is told by what it did
    (the runs it had not finished are not there), not by how long it took: the timeouts here
    only guard against a hang."""
    deadline = time.monotonic() + 300
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "never got ready"
        time.sleep(0.05)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return err


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def run_dirs(runs: Path) -> list[Path]:
    return [p for p in runs.iterdir() if not p.name.startswith(".")] if runs.is_dir() else []


@pytest.mark.parametrize("group", [True, False], ids=["ctrl-c", "main-process-only"])
def test_sweep_stops_at_once_and_keeps_whole_runs(tmp_path, group):
    (tmp_path / "base.yaml").write_text(SCENARIO)
    (tmp_path / "sweep.yaml").write_text(
        "name: slow\nbase: base.yaml\ngrid:\n  workload.arrivals.qps: [4, 5, 6, 7, 8, 9]\n")
    proc = start(tmp_path, "sweep", "sweep.yaml", "--out", "out", "--workers", "2")
    err = interrupt_when(proc, lambda: bool(run_dirs(tmp_path / "out" / "runs")), group=group)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    kept = run_dirs(tmp_path / "out" / "runs")
    assert 1 <= len(kept) < 6  # stopped with runs left, not after finishing them
    assert f"interrupted: {len(kept)} of 6 runs complete and kept in out/runs/" in err
    for run in (tmp_path / "out" / "runs").iterdir():  # no temporary or partial directory
        assert {"summary.json", "inputs.json", "requests.parquet"} <= {
            p.name for p in run.iterdir()}, run
    assert not (tmp_path / "out" / "results.parquet").exists()
    assert group_is_gone(proc.pid)  # the worker processes too


def test_sweep_stops_on_sigterm_as_on_ctrl_c(tmp_path):
    """SIGTERM to the main process (a job manager's stop) left its two workers running after
    it exited (issue 49): now met as Ctrl-C is, exiting 143, no process of its group left."""
    (tmp_path / "base.yaml").write_text(SCENARIO)
    (tmp_path / "sweep.yaml").write_text(
        "name: slow\nbase: base.yaml\ngrid:\n  workload.arrivals.qps: [4, 5, 6, 7, 8, 9]\n")
    proc = start(tmp_path, "sweep", "sweep.yaml", "--out", "out", "--workers", "2")
    err = interrupt_when(proc, lambda: bool(run_dirs(tmp_path / "out" / "runs")), group=False,
                         sig=signal.SIGTERM)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "interrupted:" in err
    assert not (tmp_path / "out" / "results.parquet").exists()
    deadline = time.monotonic() + 60  # the workers end as the main process stops them
    while not group_is_gone(proc.pid):
        assert time.monotonic() < deadline, "worker processes left running"
        time.sleep(0.1)


def test_compare_stops_and_says_which_variants_it_kept(tmp_path):
    (tmp_path / "cmp.yaml").write_text(
        "name: cmp\nbase:\n" + "".join(f"  {line}\n" for line in SCENARIO.splitlines()[2:])
        + "variants:\n  a: {seed: 1}\n  b: {seed: 2}\n  c: {seed: 3}\n")
    proc = start(tmp_path, "compare", "cmp.yaml", "--out", "out")
    err = interrupt_when(proc, lambda: (tmp_path / "out" / "a" / "summary.json").is_file())
    assert proc.returncode == 130, err
    assert "interrupted: 1 of 3 variants complete and kept in out/<variant>/ (a)" in err
    assert not (tmp_path / "out" / "comparison.csv").exists()
    assert not (tmp_path / "out" / "b").exists()


def test_capacity_stops_and_keeps_its_trials(tmp_path):
    (tmp_path / "s.yaml").write_text(SCENARIO)
    proc = start(tmp_path, "capacity", "s.yaml", "--tbt-p99", "0.5", "--out", "cap")
    trials = tmp_path / "cap" / "trials.csv"
    err = interrupt_when(
        proc, lambda: trials.is_file() and len(trials.read_text().splitlines()) >= 2)
    assert proc.returncode == 130, err
    rows = len(trials.read_text().splitlines()) - 1
    assert f"interrupted: {rows} trials kept in cap/trials.csv" in err
    assert "rate 5 req/s: meets P99 TBT" in err  # the trial, as it finished
    assert not (tmp_path / "cap" / "capacity.json").exists()
