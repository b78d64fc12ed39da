"""The copies between a replica's GPU KV cache and its CPU tier, in time, as vLLM 0.33.0's
offloading worker runs them (`offloading/worker.py`, `OffloadingConnectorWorker`, and the model
runner's calls around a step); 0.15.1's are `sim.engine.offload`. `sim.core.offload_jobs`
decides what to copy; this times it, job by job.

- Two copy queues, one per direction, each in submission order; a copy of n blocks takes n
  times the seconds one block takes over the host link.
- Before a step's forward (`handle_preemptions`): the stores the step before planned are
  submitted, each starting once the GPU has computed that step; so are the step's stores it
  must flush, and the engine waits for the flushed jobs (its launch is delayed).
- After the forward is launched: the step's loads, on a copy stream that waits for the
  compute stream (they start when the step's GPU time ends; a step with nothing to compute,
  when the last one's does); its other stores are deferred to the next step. Then the poll:
  every job done by the launch, each reported on its own (`completed_jobs`), and the
  requests whose load is done (`finished_recving`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from sim.core.offload import Report
from sim.core.offload_jobs import JobTransfers

if TYPE_CHECKING:
    from sim.core.offload import Transfers


class JobCopies:
    """The worker's copy queues, job by job (module docstring). Duck-typed like
    `sim.engine.offload.HostCopies`."""

    def __init__(self, load_s_per_block: float, store_s_per_block: float) -> None:
        self.load_s_per_block = load_s_per_block
        self.store_s_per_block = store_s_per_block
        self._jobs: dict[int, float] = {}  # job id -> when it ends, in submission order
        self._load_requests: dict[int, int] = {}  # load job id -> its request
        self._load_free_s = -math.inf
        self._store_free_s = -math.inf
        self._deferred: list[tuple[int, int]] = []  # stores for the next launch: (job, blocks)
        self._held_loads: list[tuple[int, int, int]] = []  # loads for the step's end
        self._launch_s = -math.inf
        self._computed_s = -math.inf  # when the GPU has computed the steps launched so far
        # Loads of no block (a one-token prompt asked again after its load,
        # `JobOffloadState.reload`): nothing is copied, nothing waits for them.
        self._empty: set[int] = set()
        self.polled_empty_only = False  # the last poll found only such loads done
        self.load_busy_s = 0.0
        self.store_busy_s = 0.0

    def launch(self, transfers: Transfers | JobTransfers, preempted_ids: list[int],
               finished_ids: list[int], now_s: float) -> tuple[float, Report]:
        """A step is launched at `now_s` with `transfers`: returns when the launch happens
        (later if flushed jobs must end first) and what the poll right after it finds done."""
        assert isinstance(transfers, JobTransfers)
        flush = transfers.flush
        deferred = self._deferred
        stores = transfers.stores
        if flush:
            deferred += [(job_id, n) for job_id, _, n in stores if job_id in flush]
            stores = [entry for entry in stores if entry[0] not in flush]
        for job_id, num_blocks in deferred:
            self._store(job_id, num_blocks, now_s)
        if flush:
            ends = [self._jobs[j] for j in flush if j in self._jobs]
            if ends:
                now_s = max(now_s, max(ends))
        self._deferred = [(job_id, n) for job_id, _, n in stores]
        self._launch_s = now_s
        self._held_loads = list(transfers.loads)
        if not transfers.runs:
            self._submit_loads(self._computed_s)
        return now_s, self._poll(now_s)

    def computed_by(self, end_s: float) -> None:
        """The step just launched ends on the GPU at `end_s`: its loads start no sooner."""
        if end_s > self._computed_s:
            self._computed_s = end_s
        if self._held_loads:
            self._submit_loads(end_s)

    def _store(self, job_id: int, num_blocks: int, now_s: float) -> None:
        start_s = max(now_s, self._store_free_s, self._computed_s)
        took_s = num_blocks * self.store_s_per_block
        self._store_free_s = start_s + took_s
        self.store_busy_s += took_s
        self._jobs[job_id] = self._store_free_s

    def _submit_loads(self, after_s: float) -> None:
        for job_id, request_id, num_blocks in self._held_loads:
            start_s = max(self._launch_s, self._load_free_s, after_s)
            took_s = num_blocks * self.load_s_per_block
            self._load_free_s = start_s + took_s
            self.load_busy_s += took_s
            self._jobs[job_id] = self._load_free_s
            self._load_requests[job_id] = request_id
            if not num_blocks:
                self._empty.add(job_id)
        self._held_loads = []

    def _poll(self, now_s: float) -> Report:
        report = Report()
        jobs = self._jobs
        done = [job_id for job_id, end_s in jobs.items() if end_s <= now_s]
        empty = self._empty
        self.polled_empty_only = bool(done) and all(job_id in empty for job_id in done)
        for job_id in done:
            empty.discard(job_id)
            del jobs[job_id]
            request_id = self._load_requests.pop(job_id, None)
            if request_id is not None:
                report.finished_recving.append(request_id)
        report.completed = done
        return report

    def next_done_s(self) -> float:
        """When the next copy ends (inf: none runs)."""
        empty = self._empty
        return min((end_s for job_id, end_s in self._jobs.items() if job_id not in empty),
                   default=math.inf)

    @property
    def busy(self) -> bool:
        return bool(len(self._jobs) > len(self._empty) or self._deferred
                    or any(n for _, _, n in self._held_loads))
