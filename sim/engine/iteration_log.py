"""Per-iteration records, kept as compact columns (no object per iteration)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sim.core.request import Request

COLUMNS = {
    "start_s": "d",
    "duration_s": "d",
    "num_prefill_tokens": "q",
    "num_decode_tokens": "q",
    "num_seqs": "q",
    "num_kv_blocks_used": "q",
    "num_preempted": "q",
    "num_waiting": "q",  # queue length when the iteration was scheduled
}
# Speculative decoding's replicas also log the draft tokens each iteration verified.
SPEC_COLUMN = "num_spec_tokens"
# A data-parallel rank's iterations also log the seconds each MoE layer spent exchanging tokens
# with the other ranks (`sim.engine.data_parallel`).
ALL_TO_ALL_COLUMN = "all_to_all_per_layer_s"
# Iterations after a request's one sampled token within which its second may still set its
# run's stride (`IterationLog.add_sampled`), and without decodes through which a run may go
# on; past them, a token opens a run of its own.
STRIDE_WINDOW = 256


class IterationLog:
    """Columns of one replica's iterations; the index of a row is the iteration's number."""

    def __init__(self, speculative: bool = False, data_parallel: bool = False) -> None:
        self.columns: dict[str, array] = {name: array(code) for name, code in COLUMNS.items()}
        if speculative:
            self.columns[SPEC_COLUMN] = array("q")
        if data_parallel:
            self.columns[ALL_TO_ALL_COLUMN] = array("d")
        # Each column's bound `append`, in COLUMNS order: `append` runs for every stepped
        # iteration, and eight dictionary look-ups cost as much as the appends.
        self._appends = tuple(self.columns[name].append for name in COLUMNS)
        # Tokens sampled by a pipelined replica's iterations, as strided runs: request id, first
        # iteration, the iteration its next token would extend it at, stride (tokens at first,
        # first + stride, ... before that). An async replica's decode samples in every iteration
        # (stride 1: one run while it decodes, going on through iterations in which nobody
        # decoded, SGLang's prefill batches, which hold no token of it); a pipeline of P
        # stages keeps its batches' turns while steady, a request sampling in every P-th
        # iteration (stride P: one run while it lasts, not one a token).
        # `Request.token_runs` would not do: its runs go on through iterations without a
        # token of the request while others decode. `sampled_runs` gives them as the results
        # need them: runs of consecutive iterations.
        self.sampled_request_ids = array("q")
        self.sampled_starts = array("q")
        self.sampled_ends = array("q")
        self.sampled_strides = array("q")
        self._latest_run: dict[int, int] = {}  # request id -> its latest run's row
        self._num_kept = 1024  # runs `_latest_run` holds before the ended ones are dropped
        # The last iteration in which any request decoded (-1: none yet): a request's run of
        # token iterations goes on through the iterations after it (`Request.record_token`).
        self.last_decode_iteration = -1
        # Iterations whose results the engine took after their end (with a CPU tier, a
        # launch can block it: `sim.engine.pipeline`): iteration -> when; their tokens reach
        # the client then.
        self.taken_s: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.columns["start_s"])

    def append(self, start_s: float, duration_s: float, num_prefill_tokens: int,
               num_decode_tokens: int, num_seqs: int, num_kv_blocks_used: int,
               num_preempted: int, num_waiting: int) -> int:
        """Add one iteration; return its number."""
        index = len(self.columns["start_s"])
        (start, duration, prefill, decode, seqs, kv_blocks, preempted,
         waiting) = self._appends
        start(start_s)
        duration(duration_s)
        prefill(num_prefill_tokens)
        decode(num_decode_tokens)
        seqs(num_seqs)
        kv_blocks(num_kv_blocks_used)
        preempted(num_preempted)
        waiting(num_waiting)
        if num_decode_tokens:
            self.last_decode_iteration = index
        return index

    def add_sampled(self, iteration: int, request_ids: list[int]) -> None:
        """Requests that sampled a token at the end of `iteration` (a pipelined replica),
        logged already."""
        ends, strides, latest = self.sampled_ends, self.sampled_strides, self._latest_run
        # A run of stride 1 goes on through iterations in which nobody decoded (SGLang's
        # prefill batches), those after `since`, into one with decodes (`sampled_runs` leaves
        # the others out): not one run a request a prefill batch.
        since = self._since(iteration)
        for rid in request_ids:
            row = latest.get(rid)
            if row is not None:
                end = ends[row]
                stride = strides[row]
                if stride != 1:
                    if end == iteration:
                        ends[row] = end + stride  # its run goes on
                        continue
                elif since < end <= iteration:
                    ends[row] = iteration + 1
                    continue
                elif end == self.sampled_starts[row] + 1 and end < iteration:
                    # One token so far: its second sets the stride.
                    strides[row] = stride = iteration - end + 1
                    ends[row] = iteration + stride
                    continue
            self._open(rid, iteration, iteration + 1)

    def _last_decode_before(self, iteration: int) -> int:
        """The last iteration before `iteration` in which a request decoded (looked for
        within `STRIDE_WINDOW`; before that, one is assumed, so no run goes on past it)."""
        decodes = self.columns["num_decode_tokens"]
        j = iteration - 1
        stop = iteration - STRIDE_WINDOW
        while j >= 0 and not decodes[j]:
            if j <= stop:
                return j
            j -= 1
        return j

    def add_sampled_strided(self, request_id: int, first_iter: int, num_tokens: int,
                            stride: int) -> None:
        """`add_sampled` of one request at `first_iter`, `first_iter + stride`, ...
        (`num_tokens` of them, a pipeline's stretch), the same rows: each token as a step
        adds it until its run goes on at this stride, then the rest at once."""
        last = first_iter + stride * (num_tokens - 1)
        iteration = first_iter
        while iteration <= last:
            row = self._latest_run.get(request_id)
            # (Its first token as `add_sampled` takes it: a run of stride 1 goes on into
            # an iteration only where it has decodes, as those after the first have.)
            if (row is not None and self.sampled_ends[row] == iteration
                    and self.sampled_strides[row] == stride
                    and (stride != 1 or iteration != first_iter)):
                self.sampled_ends[row] = last + stride
                return
            self.add_sampled(iteration, [request_id])
            iteration += stride

    def _since(self, iteration: int) -> int:
        """A run of stride 1 whose end is after this goes on at `iteration` (logged): the
        last iteration before it with decodes, or `iteration` itself if it has none."""
        if self.columns["num_decode_tokens"][iteration]:
            return self._last_decode_before(iteration)
        return iteration

    def add_sampled_runs(self, requests: Sequence[Request], first_iter: int,
                         num_iters: Sequence[int]) -> None:
        """Each of `requests` (in order) sampled a token at the end of each of its `num_iters`
        iterations from `first_iter` (an async replica's stretch), logged already, each
        after the first with decodes (its own)."""
        latest, ends, strides = self._latest_run, self.sampled_ends, self.sampled_strides
        since = self._since(first_iter)
        for req, n in zip(requests, num_iters, strict=True):
            if n <= 0:
                continue
            request_id = req.request_id
            row = latest.get(request_id)
            if row is not None and since < ends[row] <= first_iter and strides[row] == 1:
                ends[row] = first_iter + n
            else:
                self._open(request_id, first_iter, first_iter + n)
                latest = self._latest_run  # (`_open` may have made it anew)

    def _open(self, request_id: int, first_iter: int, end_iter: int) -> None:
        latest = self._latest_run
        if len(latest) > self._num_kept:
            # A run whose next token would be before this iteration never goes on
            # (iterations come in order), unless it holds one token, whose second may come
            # any time: forget those within `STRIDE_WINDOW` too, so the map holds about the
            # requests running.
            ends, window = self.sampled_ends, first_iter - STRIDE_WINDOW
            self._latest_run = latest = {r: k for r, k in latest.items() if ends[k] >= window}
            self._num_kept = max(1024, 2 * len(latest))
        latest[request_id] = len(self.sampled_ends)
        self.sampled_request_ids.append(request_id)
        self.sampled_starts.append(first_iter)
        self.sampled_ends.append(end_iter)
        self.sampled_strides.append(1)

    def sampled_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sampled tokens as runs of consecutive iterations, each as long as it goes (no
        two of a request's touch): (request ids, first iterations, end iterations), by
        request, then in time."""
        ids = np.frombuffer(self.sampled_request_ids, dtype=np.int64)
        starts = np.frombuffer(self.sampled_starts, dtype=np.int64)
        ends = np.frombuffer(self.sampled_ends, dtype=np.int64)
        strides = np.frombuffer(self.sampled_strides, dtype=np.int64)
        # A strided run is one run a token; a run of stride 1 stays whole.
        apart = strides != 1
        pieces = np.where(apart, (ends - starts) // strides, 1)
        row = np.repeat(np.arange(len(ids)), pieces)
        k = np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        run_start = starts[row] + k * strides[row]
        run_end = np.where(apart[row], run_start + 1, ends[row])
        run_id = ids[row]
        # A run of stride 1 holds no token in the iterations without decodes it went through.
        idle = np.flatnonzero(np.frombuffer(self.columns["num_decode_tokens"],
                                            dtype=np.int64) == 0)
        split = split_at_idle(idle, run_start, run_end)
        if split is not None:
            piece_of, run_start, run_end = split
            run_id = run_id[piece_of]
        order = np.lexsort((run_start, run_id))
        run_id, run_start, run_end = run_id[order], run_start[order], run_end[order]
        # Runs of a request that touch are one: a strided run's tokens and a run beside them.
        joins = (run_id[1:] == run_id[:-1]) & (run_end[:-1] == run_start[1:])
        if joins.any():
            first = np.concatenate(([True], ~joins))
            last = np.concatenate((~joins, [True]))
            run_id, run_start, run_end = run_id[first], run_start[first], run_end[last]
        return run_id, run_start, run_end

    def sampled_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """The sampled tokens one entry each: (request ids, iterations), run by run."""
        ids, starts, ends = self.sampled_runs()
        counts = ends - starts
        offsets = np.repeat(np.cumsum(counts) - counts, counts)
        return (np.repeat(ids, counts),
                np.repeat(starts, counts) + np.arange(int(counts.sum())) - offsets)

    def set_duration(self, index: int, duration_s: float) -> None:
        """Correct an iteration's duration once its end is known (a replay ends an iteration
        after committing it)."""
        self.columns["duration_s"][index] = duration_s

    def extend_stretch(self, start_s: np.ndarray, duration_s: np.ndarray,
                       num_seqs: int | list[int], num_kv_blocks_used: list[int],
                       num_preempted_first: int = 0,
                       num_prefill_tokens: list[int] | None = None) -> int:
        """Add a stretch of iterations (`sim.engine.fastpath.stretch`), the first of which preempted
        `num_preempted_first` requests when it was planned; return the number of the first.
        `num_seqs`: one number for every iteration, or one per iteration where requests leave
        the batch as they finish. Each request in an iteration decodes but for one computing
        a chunk of its prompt in the first `len(num_prefill_tokens)` iterations."""
        c = self.columns
        index = len(c["start_s"])
        k = len(start_s)
        c["start_s"].frombytes(start_s.astype(np.float64, copy=False).tobytes())
        c["duration_s"].frombytes(duration_s.astype(np.float64, copy=False).tobytes())
        seqs = array("q", num_seqs) if isinstance(num_seqs, list) else array("q", (num_seqs,)) * k
        if num_prefill_tokens:
            chunks = len(num_prefill_tokens)
            c["num_prefill_tokens"].extend(array("q", num_prefill_tokens))
            c["num_prefill_tokens"].frombytes(bytes(8 * (k - chunks)))
            decodes = array("q", seqs)
            for j in range(chunks):
                decodes[j] -= 1
            c["num_decode_tokens"].extend(decodes)
            # The prompt's request decodes after its chunks; beside them, the others do.
            if k > chunks or decodes[0]:
                self.last_decode_iteration = index + k - 1
        else:
            c["num_prefill_tokens"].frombytes(bytes(8 * k))
            c["num_decode_tokens"].extend(seqs)
            if k:
                self.last_decode_iteration = index + k - 1
        c["num_seqs"].extend(seqs)
        c["num_kv_blocks_used"].extend(array("q", num_kv_blocks_used))
        preempted = array("q", bytes(8 * k))
        if k:
            preempted[0] = num_preempted_first
        c["num_preempted"].extend(preempted)
        c["num_waiting"].frombytes(bytes(8 * k))  # a stretch runs only while nothing waits
        return index

    def end_s(self) -> np.ndarray:
        """End time of every iteration (start plus duration, as the engine computed it)."""
        return np.frombuffer(self.columns["start_s"], dtype=np.float64) + np.frombuffer(
            self.columns["duration_s"], dtype=np.float64)

    def output_s(self) -> np.ndarray:
        """When each iteration's tokens leave the engine: its end, or later where the engine
        took its result later (`taken_s`)."""
        ends = self.end_s()
        if self.taken_s:
            ends = ends.copy()
            for i, t in self.taken_s.items():
                ends[i] = t
        return ends

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(col, dtype=np.float64 if col.typecode == "d" else np.int64)
                for name, col in self.columns.items()}


def split_at_idle(idle: np.ndarray, start: np.ndarray, end: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Runs [start, end) of a request's tokens, each holding one at its first iteration and at
    every later one not in `idle` (sorted iterations without decodes), cut into runs of
    consecutive iterations: (the run each piece is of, its start, its end); None if no run
    has an idle iteration past its first."""
    if not len(start) or not len(idle):
        return None
    # The idle iterations inside each run, (start, end): a run's first may be idle itself
    # (the first token, at the end of a prompt's last chunk).
    lo = np.searchsorted(idle, start, side="right")
    cuts = np.searchsorted(idle, end, side="left") - lo
    if not cuts.any():
        return None
    pieces = cuts + 1
    run = np.repeat(np.arange(len(start)), pieces)
    pos = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    cut = lo[run] + pos  # the idle iteration that ends piece `pos` (all but the last piece)
    last = len(idle) - 1
    piece_start = np.where(pos == 0, start[run], idle[np.minimum(cut - 1, last)] + 1)
    piece_end = np.where(pos == cuts[run], end[run], idle[np.minimum(cut, last)])
    keep = piece_end > piece_start  # nothing between two idle iterations in a row
    return run[keep], piece_start[keep], piece_end[keep]
