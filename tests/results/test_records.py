"""Records of a run (`sim.results.records`): token statistics from token runs (issue 14: no
per-token arrays) by hand, runs split at iterations without decodes, and the request frame's
columns."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.request import Request
from sim.engine.iteration_log import IterationLog
from sim.results.columns import to_frame
from sim.results.metrics.summary import FINISHED_COLUMNS, WeightedSample, distribution
from sim.results.records import TokenRuns, request_table, token_stats


def runs(*rows: tuple[int, int, int], num_requests: int) -> TokenRuns:
    owner, start, end = (np.array(col, dtype=np.int64) for col in zip(*rows, strict=True))
    return TokenRuns(owner, start, end, np.bincount(owner, minlength=num_requests))


def test_token_stats_by_hand():
    # Iterations end at these times (one replica's log, or several laid end to end).
    end_s = np.array([1.0, 2.0, 4.0, 7.0, 11.0, 16.0, 22.0])
    stats = token_stats(runs(
        (0, 0, 3),  # request 0: tokens at 1, 2, 4 (gaps 1, 2) ...
        (0, 5, 7),  # ... then preempted: 16 (gap 12 across runs), 22 (gap 6)
        (2, 3, 4),  # request 2: one token, at 7
        (3, 1, 7),  # request 3: 2 .. 22, up to the last iteration (gaps 2, 3, 4, 5, 6)
        (4, 6, 7),  # request 4: one token at 22 ...
        num_requests=6), end_s)  # requests 1 and 5: no tokens
    np.testing.assert_array_equal(stats.num_tokens, [5, 0, 1, 6, 1, 0])
    np.testing.assert_array_equal(stats.first_token_s, [1.0, np.nan, 7.0, 2.0, 22.0, np.nan])
    np.testing.assert_array_equal(stats.last_token_s, [22.0, np.nan, 7.0, 22.0, 22.0, np.nan])
    np.testing.assert_array_equal(stats.max_gap_s, [12.0, np.nan, np.nan, 6.0, np.nan, np.nan])
    expanded = np.repeat(stats.gaps.values, stats.gaps.counts)
    assert sorted(expanded) == sorted([1.0, 2.0, 12.0, 6.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_token_stats_of_nothing():
    stats = token_stats(runs((0, 0, 1), num_requests=2), np.array([0.5]))
    np.testing.assert_array_equal(stats.max_gap_s, [np.nan, np.nan])
    assert stats.gaps.size == 0
    assert distribution(stats.gaps)["count"] == 0
    empty = token_stats(TokenRuns(*(np.zeros(0, dtype=np.int64),) * 3,
                                  np.zeros(3, dtype=np.int64)), np.zeros(0))
    np.testing.assert_array_equal(empty.num_tokens, [0, 0, 0])
    assert empty.gaps.size == 0


def test_request_frame_columns_unchanged():
    """Column names and dtypes of the request frame (what result files and notebooks read)."""
    requests = [Request(0, 0.0, 10, 3), Request(1, 0.5, 10, 3)]
    table, gaps = request_table(requests, [IterationLog()])
    frame = to_frame(table)
    assert isinstance(gaps, WeightedSample)
    assert list(frame.columns) == [
        "request_id", "replica_id", "decode_replica_id", "arrival_s", "num_prompt_tokens",
        "num_output_tokens", "num_generated_tokens", "first_scheduled_s", "first_token_s",
        "finish_s", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
        "num_recomputed_tokens", "status", "reason", "scheduling_delay_s", "ttft_s", "e2e_s",
        "tpot_s", "max_tbt_s", "prefill_end_s", "transfer_start_s", "transfer_wire_start_s",
        "transfer_end_s",
        "decode_wait_s", "transfer_s", "failed_s", "num_drafts_verified",
        "num_drafts_accepted"]
    assert frame["num_generated_tokens"].dtype == np.int64
    assert all(frame[c].dtype == np.float64 for c in FINISHED_COLUMNS)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.data())
def test_runs_are_cut_at_each_iteration_without_decodes(decodes, data):
    """`split_where_none_decoded` against the tokens written out: a run [first, end) holds a
    token at first and at each later iteration with decodes; the pieces are those tokens'
    runs of consecutive iterations."""
    from sim.results.records import split_where_none_decoded

    log = IterationLog()
    for n in decodes:
        log.append(0.0, 1.0, 0, n, max(n, 1), 0, 0, 0)
    num = len(decodes)
    # Runs whose last iteration holds a token (its first, or one with decodes).
    ends_ok = [j for j in range(num) if decodes[j] > 0]
    runs = []
    for owner in range(data.draw(st.integers(1, 6))):
        first = data.draw(st.integers(0, num - 1))
        last = data.draw(st.sampled_from([first] + [j for j in ends_ok if j > first]))
        runs.append((owner, first, last + 1))
    owner, start, end = (np.array(col, dtype=np.int64) for col in zip(*runs, strict=True))
    expected = []
    for o, first, stop in runs:
        tokens = [j for j in range(first, stop) if j == first or decodes[j] > 0]
        piece = [tokens[0]]
        for j in tokens[1:]:
            if j == piece[-1] + 1:
                piece.append(j)
            else:
                expected.append((o, piece[0], piece[-1] + 1))
                piece = [j]
        expected.append((o, piece[0], piece[-1] + 1))
    split = split_where_none_decoded(owner, start, end, [log])
    got = runs if split is None else list(zip(*(a.tolist() for a in split), strict=True))
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), max_size=6), min_size=1, max_size=60),
       st.lists(st.booleans(), min_size=60, max_size=60),
       st.lists(st.booleans(), min_size=60, max_size=60), st.integers(1, 8))
def test_sampled_runs_hold_every_token_once(iterations, as_run, idle, num_kept):
    """A pipelined replica's sampled tokens, logged iteration by iteration (`add_sampled`) or a
    stretch's requests' consecutive ones at once (`add_sampled_runs`), come back token for
    token; a run
    goes on over consecutive iterations of one request and through iterations in which nobody
    decoded (`idle`: SGLang's prefill batches, where a request may still sample its first
    token), and forgetting ended runs (`num_kept` small) loses none."""
    log = IterationLog()
    log._num_kept = num_kept
    expected: list[tuple[int, int]] = []
    j = 0
    for step, ids in enumerate(iterations):
        ids = list(dict.fromkeys(ids))  # a request samples once an iteration
        if as_run[step] and ids:
            # A stretch of three iterations: each id's tokens in the first 1, 2 or 3 of them
            # (by its value). The first iteration may compute prompts (none decodes in it);
            # in the others every one left decodes.
            lengths = [1 + rid % 3 for rid in ids]
            for i in range(3):
                log.append(0.0, 1.0, 0, 0 if i == 0 and idle[step] else 1, 1, 0, 0, 0)
            log.add_sampled_runs([Request(rid, 0.0, 10, 10) for rid in ids], j, lengths)
            expected += [(rid, j + i) for rid, n in zip(ids, lengths, strict=True)
                         for i in range(n)]
            j += 3
            continue
        log.append(0.0, 1.0, 0, 0 if idle[step] else max(len(ids), 1), 1, 0, 0, 0)
        log.add_sampled(j, ids)
        expected += [(rid, j) for rid in ids]
        j += 1
    ids, its = log.sampled_tokens()
    assert sorted(zip(ids.tolist(), its.tolist(), strict=True)) == sorted(expected)
    run_ids, starts, ends = log.sampled_runs()
    assert (ends > starts).all()
    # Runs are maximal: no two of a request's runs touch, nor overlap.
    last_end: dict[int, int] = {}
    for rid, s, e in zip(run_ids.tolist(), starts.tolist(), ends.tolist(), strict=True):
        assert last_end.get(rid, -1) < s
        last_end[rid] = e


def test_a_run_goes_on_through_prefill_batches_not_one_a_batch():
    """SGLang's overlap loop: a prefill batch now and then, in which nobody decodes, between
    decode batches in which every running request samples. Each request logs one row, not one
    for each prefill batch that kept it out; its tokens come back without those batches."""
    log = IterationLog()
    expected = []
    for j in range(300):
        prefill = j % 7 == 3
        log.append(0.0, 1.0, 100 if prefill else 0, 0 if prefill else 4, 4, 0, 0, 0)
        if not prefill:
            log.add_sampled(j, [0, 1, 2, 3])
            expected += [(rid, j) for rid in range(4)]
    assert len(log.sampled_starts) == 4
    ids, its = log.sampled_tokens()
    assert sorted(zip(ids.tolist(), its.tolist(), strict=True)) == sorted(expected)
    run_ids, starts, _ = log.sampled_runs()
    assert len(run_ids) == 4 * len(range(3, 300, 7)) + 4  # cut at each prefill batch


def test_a_steady_pipeline_logs_a_run_a_request_not_a_token():
    """Four batches taking turns down a pipeline of four stages: each request samples in every
    fourth iteration, logged as one strided run (not one a token), and given back token for
    token as one-token runs; a request that breaks its stride opens a run of its own."""
    log = IterationLog()
    for j in range(402):
        log.append(0.0, 1.0, 0, 3, 3, 0, 0, 0)
        if j < 400:
            log.add_sampled(j, [10 * (j % 4) + i for i in range(3)])
    log.add_sampled(401, [0])  # its stride broken (400 would have been its turn)
    assert len(log.sampled_starts) == 13  # 12 requests' runs, and the broken one's second
    ids, its = log.sampled_tokens()
    assert sorted(zip(ids.tolist(), its.tolist(), strict=True)) == sorted(
        [(10 * (j % 4) + i, j) for j in range(400) for i in range(3)] + [(0, 401)])
    run_ids, starts, ends = log.sampled_runs()
    assert len(run_ids) == 1201 and (ends - starts == 1).all()
