"""Running a sweep's points: in this process, on local worker processes, or as Ray tasks.

One error path everywhere: the worker function never raises. It returns a record, and the
main process acts on it: an input problem (a missing trace, a bad field) ends the sweep as one
`InputError` with a line per problem; any other failure as a `SweepCrashed` carrying the
worker's traceback. Either way, and on Ctrl-C, queued runs are cancelled and running ones
stopped at once; every finished run stays on disk whole (`sim.results.outdir.write_dir`).
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from sim.config.errors import COMMAND_LINE, InputError
from sim.config.scenario import Scenario
from sim.results.fingerprint import inputs_record
from sim.results.outdir import check_out_dir, write_dir


@dataclass(frozen=True)
class Job:
    """One run to do: its scenario, its directory and the input files its key was made from."""

    scenario: Scenario
    out_dir: str
    inputs: list[dict[str, Any]]


class SweepFailed(InputError):
    """Input problems met while running a sweep's points (possibly in several files): each of
    `lines()` is one problem."""

    def __init__(self, lines: list[str]) -> None:
        self._lines = list(dict.fromkeys(lines))  # the same bad trace, met by several points
        super().__init__(None, "sweep", None, self._lines[0])

    def lines(self) -> list[str]:
        return list(self._lines)

    def one_line(self) -> str:
        return self._lines[0]


class SweepCrashed(RuntimeError):
    """A run failed for a reason other than its input (a bug): the worker's traceback."""


def run_jobs(jobs: list[Job], *, workers: int | None = None, backend: str = "local",
             address: str | None = None, on_done: Callable[[Job], None] | None = None) -> None:
    """Run `jobs`, calling `on_done(job)` as each finishes; raise at the first failure.
    `workers`: processes (local; None: one, in this process), or Ray tasks at once (None: as
    many as the cluster runs)."""
    if not jobs:
        return

    def finished(job: Job, record: dict[str, Any]) -> None:
        if record["status"] == "input_error":
            raise SweepFailed(record["lines"])
        if record["status"] == "crashed":
            raise SweepCrashed(f"a sweep run ({job.out_dir}) failed:\n{record['traceback']}")
        if on_done is not None:
            on_done(job)

    if backend == "ray":
        _run_ray(jobs, address, workers, finished)
    elif workers is None or workers <= 1 or len(jobs) == 1:
        for job in jobs:
            finished(job, run_one(job))
    else:
        _run_local(jobs, workers, finished)


def run_one(job: Job) -> dict[str, Any]:
    """Run one job and write its directory whole; return a record, never raise (so nothing
    has to be unpickled in the main process): `status` done, input_error (with `lines`, one per
    problem, and the first problem's `source`, `field`, `value`, `problem`) or crashed (with
    `traceback`)."""
    global _running
    _running = True
    try:
        _run(job)
        return {"status": "done"}
    except InputError as exc:
        return {"status": "input_error", "lines": exc.lines(), "source": exc.source,
                "field": exc.field, "value": repr(exc.value)[:200], "problem": exc.problem}
    except _Terminated:
        os._exit(128 + signal.SIGTERM)
    except Exception:
        return {"status": "crashed", "traceback": traceback.format_exc()}
    finally:
        _running = False


def _run(job: Job) -> None:
    from sim.runner import run_scenario

    out = Path(job.out_dir)
    check_out_dir(out)
    _check_unchanged(job)
    results = run_scenario(job.scenario)

    def write(tmp: Path) -> None:
        # Inside the atomic write: a run directory has its input record or is not there. The
        # inputs as hashed when the run was keyed, not hashed again.
        results.write_files(tmp, job.inputs)

    write_dir(out, write)


def _check_unchanged(job: Job) -> None:
    """The input files still hash to what the run's key was made from."""
    now = {r["field"]: r["sha256"] for r in inputs_record(job.scenario)}
    for given in job.inputs:
        if now.get(given["field"]) != given["sha256"]:
            raise InputError(given["path"], given["field"], given["path"],
                             "changed while the sweep ran: run the sweep again")


# Worker processes: Ctrl-C reaches the whole process group, but only the main process decides
# what stops; SIGTERM (sent by the main process) unwinds a run, so that its temporary directory
# is removed, then ends the process.
_running = False


class _Terminated(BaseException):
    pass


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _running:
        raise _Terminated
    os._exit(128 + signum)


def _run_local(jobs: list[Job], workers: int,
               finished: Callable[[Job, dict[str, Any]], None]) -> None:
    pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs)), initializer=_worker_init)
    try:
        futures = {pool.submit(run_one, job): job for job in jobs}
        for future in as_completed(futures):
            finished(futures[future], future.result())
    except BaseException as exc:
        _stop(pool)
        if isinstance(exc, BrokenProcessPool):
            raise SweepCrashed("a sweep worker process died (killed, or out of memory?); "
                               "finished runs are kept") from None
        raise
    pool.shutdown()


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel queued runs and end the worker processes now (Python before 3.14 has no public
    way to stop a running worker, hence `_processes`)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    # Wait for the pool's manager thread to notice and close its wake-up pipe. Left running,
    # it races concurrent.futures' exit hook, which writes to that pipe while the thread
    # closes it: "OSError: Bad file descriptor" printed on the way out (Python 3.11; seen in
    # about 1 of 30 interrupted sweeps on a loaded machine).
    if manager is not None:
        manager.join(timeout=10)


def init_ray(address: str | None, workers: int | None) -> Any:
    """Ray, connected to the cluster at `address` (None: a local one of `workers` CPUs);
    refused in one line where Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise InputError(COMMAND_LINE, "--backend", "ray", "Ray is not installed: pip install "
                         "'servesim[ray]'") from None
    import logging

    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False,
             num_cpus=workers if address is None else None)
    return ray


def _run_ray(jobs: list[Job], address: str | None, workers: int | None,
             finished: Callable[[Job, dict[str, Any]], None]) -> None:
    """The same runs as Ray tasks, on an existing cluster (`address`) or a local one (of
    `workers` CPUs), at most `workers` at once."""
    ray = init_ray(address, workers)
    remote = ray.remote(max_retries=0)(run_one)
    queue = list(reversed(jobs))
    pending: dict[Any, Job] = {}
    try:
        while queue or pending:
            while queue and (workers is None or len(pending) < workers):
                job = queue.pop()
                pending[remote.remote(job)] = job
            ready, _ = ray.wait(list(pending), num_returns=1)
            finished(pending.pop(ready[0]), ray.get(ready[0]))
    except BaseException:
        refs = list(pending)
        for ref in refs:  # a running task gets a KeyboardInterrupt and unwinds
            ray.cancel(ref)
        if refs:
            # Wait for them to end: one still writing would leave its temporary directory
            # after the caller has removed the partial runs (seen on a loaded machine).
            _, left = ray.wait(refs, num_returns=len(refs), timeout=30)
            for ref in left:
                ray.cancel(ref, force=True)
            if left:
                ray.wait(left, num_returns=len(left), timeout=10)
        raise
