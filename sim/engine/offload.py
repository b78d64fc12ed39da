"""The copies between a replica's GPU KV cache and its CPU tier, in time: vLLM's offloading
worker (`OffloadingConnectorWorker`, `v1/kv_offload/worker/cpu_gpu.py`, 0.15.1), as the engine
runs it around each step. `sim.core.offload` decides what to copy; this times it.

- Two copy queues, one per direction, each in submission order (a transfer's stream waits for
  the one before: `SingleDirectionOffloadingHandler.transfer_async`). A copy of n blocks takes
  n times the seconds one block takes over the host link (`seconds_per_block`).
- When a step is launched (`launch`, at the engine's clock when it sends the step): the
  stores the step before planned are submitted now ("defer the store to the beginning of the
  next engine step"), each starting once the GPU has computed that step (the copy stream waits
  for the compute stream); then the step's loads, which start at once. A step with
  preemptions first waits for the preempted requests' copies (`handle_preemptions`), which
  delays its launch.
- Right after the launch the worker polls (`get_finished`, on exiting the forward's context):
  loads done by then, and requests that finished (the step's `finished_req_ids`) whose stores
  are all done by then (or later, at the first poll after they are). The scheduler applies the
  report with the step's output.
A step that schedules nothing still launches and polls (`kv_connector_no_forward`), in no time.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from sim.core.offload import Report, Transfers

if TYPE_CHECKING:
    from sim.core.offload_jobs import JobTransfers
    pass


class HostCopies:
    """The worker's copy queues and per-request jobs (module docstring)."""

    def __init__(self, load_s_per_block: float, store_s_per_block: float) -> None:
        self.load_s_per_block = load_s_per_block
        self.store_s_per_block = store_s_per_block
        # (done_s, request id), in submission order: each queue runs in order.
        self._loads: deque[tuple[float, int]] = deque()
        self._stores: deque[tuple[float, int]] = deque()
        self._load_free_s = -math.inf
        self._store_free_s = -math.inf
        self._store_jobs: dict[int, int] = {}  # request id -> its store copies not done
        self._waiting_for_store: set[int] = set()  # finished, copies still running
        # Stores planned by the last step launched, to submit at the next launch, and when
        # the GPU will have computed that step.
        self._deferred: list[tuple[int, int]] = []
        self._deferred_after_s = -math.inf
        # Totals (`summary.kv_offload`).
        self.load_busy_s = 0.0
        self.store_busy_s = 0.0

    def launch(self, transfers: Transfers | JobTransfers, preempted_ids: list[int],
               finished_ids: list[int], now_s: float) -> tuple[float, Report]:
        """A step is launched at `now_s` with `transfers` (its loads now, its stores deferred
        to the next launch, once the GPU has computed the step: `computed_by`): returns when
        the launch happens (later if a preempted request's copies must finish first) and what
        the poll right after it finds done."""
        assert isinstance(transfers, Transfers)
        if preempted_ids:
            self._submit_deferred(now_s)
            preempted = set(preempted_ids)
            ends = [done_s for done_s, rid in self._stores if rid in preempted]
            if ends:
                now_s = max(now_s, max(ends))
        self._submit_deferred(now_s)
        for rid, num_blocks in transfers.loads:
            start_s = max(now_s, self._load_free_s)
            took_s = num_blocks * self.load_s_per_block
            self._load_free_s = start_s + took_s
            self.load_busy_s += took_s
            self._loads.append((self._load_free_s, rid))
        for rid, _ in transfers.stores:
            self._store_jobs[rid] = self._store_jobs.get(rid, 0) + 1
        self._deferred = list(transfers.stores)
        self._deferred_after_s = now_s
        return now_s, self._poll(now_s, finished_ids)

    def computed_by(self, end_s: float) -> None:
        """The step just launched ends on the GPU at `end_s`: its stores start no sooner."""
        self._deferred_after_s = end_s

    def _submit_deferred(self, now_s: float) -> None:
        for rid, num_blocks in self._deferred:
            start_s = max(now_s, self._store_free_s, self._deferred_after_s)
            took_s = num_blocks * self.store_s_per_block
            self._store_free_s = start_s + took_s
            self.store_busy_s += took_s
            self._stores.append((self._store_free_s, rid))
        self._deferred = []

    def _poll(self, now_s: float, finished_ids: list[int]) -> Report:
        """`get_finished`: the copies done by `now_s`, per request, and the requests just
        finished whose stores are all done."""
        report = Report()
        loads, stores = self._loads, self._stores
        while loads and loads[0][0] <= now_s:
            report.finished_recving.append(loads.popleft()[1])
        jobs, waiting = self._store_jobs, self._waiting_for_store
        while stores and stores[0][0] <= now_s:
            rid = stores.popleft()[1]
            jobs[rid] -= 1
            if not jobs[rid] and rid in waiting:
                waiting.remove(rid)
                report.finished_sending.append(rid)
                del jobs[rid]
        for rid in finished_ids:
            left = jobs.get(rid)
            if left:
                waiting.add(rid)
            elif left is not None:
                report.finished_sending.append(rid)
                del jobs[rid]
        return report

    def next_done_s(self) -> float:
        """When the next copy ends (inf: none runs); a deferred store counts as starting
        at its step's end (it is submitted at the next launch, which a poll is)."""
        soonest = math.inf
        if self._loads:
            soonest = self._loads[0][0]
        if self._stores:
            soonest = min(soonest, self._stores[0][0])
        return soonest

    @property
    def busy(self) -> bool:
        """Copies running or a finished request waiting for its stores."""
        return bool(self._loads or self._stores or self._waiting_for_store or self._deferred)
