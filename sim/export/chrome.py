"""A run as a Trace Event Format file (the JSON object form: `traceEvents`, `displayTimeUnit`),
which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Tracks (times in µs from the first arrival, rounded to the ns):
- one process per replica, its iterations as complete slices (`ph: "X"`) named by what they
  ran (`prefill`, `decode`, `prefill+decode`) with the batch in `args`, on thread 0
  (`iterations`); counters (`ph: "C"`) `queue` (`num_waiting`) and `KV blocks`
  (`num_kv_blocks_used`), an entry where they change. A pipelined replica keeps up to P
  iterations in flight, which overlap, and slices on one thread may only nest: each iteration
  goes to the lowest-numbered thread free at its start, so thread k (`iterations (in flight
  k+1)`) holds those sent while threads 0 to k-1 were all busy (at most P threads);
- disaggregated runs: a `KV links` process, one thread per prefill replica's link, each
  finished transfer a slice while its KV is on the wire (from `transfer_wire_start_s`: a link
  sends one transfer at a time; the time queued before is in `args.queued_ms`);
- a `requests` process for a sample of requests (`num_flows`, evenly spaced over request ids):
  a thread each, a slice from arrival to finish (or the run's end) split into waiting for the
  first token and decoding, and a flow (`ph: "s"/"t"/"f"`) from its arrival to the iteration of
  its first token, across its KV transfer, to the iteration that finished it.

No cap: a file takes about 300 bytes per iteration (the default scenario, 41k iterations: 12 MB
in 2 s; a 2+2 disaggregated run of the Azure conversation trace at 4x, 221k iterations: 75 MB in
8 s). Perfetto opens a few hundred MB; chrome://tracing gives up sooner.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from sim.results.run_dir import Results

US = 1e6  # trace time unit: microseconds
# Each replica's iteration starts and ends (s), as the engine computed them, and the thread
# (track) each is drawn on.
Spans = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]


def chrome_trace(results: Results, num_flows: int = 20) -> dict[str, Any]:
    """The run's iterations, queue and KV counters, KV transfers and a sample of request flows
    as a Trace Event Format object."""
    replicas = {int(r["replica_id"]): str(r["pool"]) for r in results.summary["replicas"]}
    link_pid, request_pid = len(replicas) + 1, len(replicas) + 2
    events: list[dict[str, Any]] = []
    iteration_events: list[dict[str, Any]] = []
    spans: Spans = {}
    for replica_id, pool in sorted(replicas.items()):
        pid = replica_id + 1
        its = results.iterations[results.iterations["replica_id"] == replica_id]
        start = its["start_s"].to_numpy(dtype=np.float64)
        end = start + its["duration_s"].to_numpy(dtype=np.float64)
        tracks = iteration_tracks(_us(start), _us(end))
        num_tracks = int(tracks.max()) + 1 if len(tracks) else 1
        events += [_meta("process_name", pid, 0, f"replica {replica_id} ({pool})"),
                   _meta("process_sort_index", pid, 0, replica_id, key="sort_index")]
        events += [_meta("thread_name", pid, k, _track_name(k)) for k in range(num_tracks)]
        iteration_events += iteration_slices(its, pid, tracks)
        spans[replica_id] = (start, end, tracks)
    transfers = wire_intervals(results.requests)
    links = sorted(set(transfers["replica_id"].tolist()))
    if links:
        events += [_meta("process_name", link_pid, 0, "KV links"),
                   _meta("process_sort_index", link_pid, 0, link_pid, key="sort_index")]
        events += [_meta("thread_name", link_pid, r, f"link from replica {r}") for r in links]
    transfer_events = transfer_slices(transfers, link_pid)
    sample = sample_requests(results.requests, num_flows)
    end_s = float(results.summary["run"]["end_s"])
    request_events = request_slices(sample, request_pid, end_s)
    if len(sample):
        events += [_meta("process_name", request_pid, 0, f"requests ({len(sample)} sampled)"),
                   _meta("process_sort_index", request_pid, 0, request_pid, key="sort_index")]
        events += [_meta("thread_name", request_pid, int(i), f"request {int(i)}")
                   for i in sample["request_id"]]
    flows = [e for row in _records(sample)
             for e in request_flow(row, spans, transfers, link_pid, request_pid)]
    events += iteration_events + transfer_events + request_events + flows
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "servesim export --format chrome",
            "scenario": results.scenario.name,
            "seed": results.scenario.seed,
            "num_iterations": len(results.iterations),
            "num_transfers": len(transfer_events),
            "num_sampled_requests": len(sample),
            "num_flows": len({e["id"] for e in flows}),
        },
    }


def iteration_tracks(start_us: np.ndarray, end_us: np.ndarray) -> np.ndarray:
    """The thread of each of a replica's iterations (given in start order, as the engine sends
    them): the lowest-numbered one whose last slice has ended by its start. Slices on a thread
    then never overlap; the times compared are those written (rounded µs), so that iterations
    back to back share a thread. Without a pipeline every iteration is on thread 0."""
    tracks = np.zeros(len(start_us), dtype=np.int64)
    # No iteration starts before all earlier ones have ended (no pipeline): no loop.
    if len(start_us) < 2 or (start_us[1:] >= np.maximum.accumulate(end_us[:-1])).all():
        return tracks
    free_us: list[float] = []  # when each thread's last slice ends
    for k, (start, end) in enumerate(zip(start_us.tolist(), end_us.tolist(), strict=True)):
        # At most P threads (iterations in flight): a short scan.
        track = next((t for t, free in enumerate(free_us) if free <= start), len(free_us))
        if track == len(free_us):
            free_us.append(end)
        else:
            free_us[track] = end
        tracks[k] = track
    return tracks


def iteration_slices(its: pd.DataFrame, pid: int, tracks: np.ndarray) -> list[dict[str, Any]]:
    """One replica's iterations as slices, each on its thread in `tracks`, then its counters
    where they change."""
    start = _us(its["start_s"].to_numpy(dtype=np.float64))
    # Durations from rounded ends, so that back-to-back iterations stay back to back.
    dur = np.round(_us((its["start_s"] + its["duration_s"]).to_numpy(dtype=np.float64))
                   - start, 3)
    cols = {c: its[c].to_numpy(dtype=np.int64).tolist() for c in (
        "iteration", "num_prefill_tokens", "num_decode_tokens", "num_seqs",
        "num_kv_blocks_used", "num_preempted", "num_waiting")}
    out = []
    for k, (ts, d, tid) in enumerate(zip(start.tolist(), dur.tolist(), tracks.tolist(),
                                         strict=True)):
        args = {c: v[k] for c, v in cols.items()}
        out.append({"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": d, "cat": "iteration",
                    "name": _kind(args["num_prefill_tokens"], args["num_decode_tokens"]),
                    "args": args})
    for name, column in (("queue", "num_waiting"), ("KV blocks", "num_kv_blocks_used")):
        values = cols[column]
        out += [{"ph": "C", "pid": pid, "tid": 0, "ts": start[k].item(), "name": name,
                 "args": {column: values[k]}}
                for k in range(len(values)) if k == 0 or values[k] != values[k - 1]]
    return out


def wire_intervals(requests: pd.DataFrame) -> pd.DataFrame:
    """Finished KV transfers with `wire_start_s`, in each link's order (by end): when the
    engine put each on the wire (`transfer_wire_start_s`). Results written before that column
    existed get it worked out as the engine's links ran then: one transfer at a time, first
    come first served, so the wire starts at the later of the transfer's start and the end of
    the one before it."""
    done = requests[requests["transfer_end_s"].notna()].sort_values(
        ["replica_id", "transfer_end_s", "transfer_start_s", "request_id"], kind="stable")
    if "transfer_wire_start_s" in done.columns:
        return done.assign(wire_start_s=done["transfer_wire_start_s"].to_numpy())
    previous_end = done.groupby("replica_id")["transfer_end_s"].shift(1)
    wire = np.fmax(done["transfer_start_s"].to_numpy(), previous_end.to_numpy())
    return done.assign(wire_start_s=wire)


def transfer_slices(transfers: pd.DataFrame, pid: int) -> list[dict[str, Any]]:
    out = []
    for row in _records(transfers):
        rid = int(row["request_id"])
        args = {"request_id": rid, "decode_replica_id": int(row["decode_replica_id"]),
                "num_prompt_tokens": int(row["num_prompt_tokens"]),
                "queued_ms": _ms(row["wire_start_s"] - row["transfer_start_s"])}
        out.append(_slice(pid, int(row["replica_id"]), row["wire_start_s"],
                          row["transfer_end_s"], f"KV of request {rid}", "transfer", args))
    return out


def sample_requests(requests: pd.DataFrame, num_flows: int) -> pd.DataFrame:
    """`num_flows` requests evenly spaced over the request ids (first and last included); every
    request where there are no more than that."""
    ordered = requests.sort_values("request_id", kind="stable")
    if num_flows <= 0 or not len(ordered):
        return ordered.iloc[:0]
    # Never more points than requests: `--num-flows 99999999999` asked numpy for 745 GiB.
    count = min(num_flows, len(ordered))
    picks = np.unique(np.round(np.linspace(0, len(ordered) - 1, count)).astype(np.int64))
    return ordered.iloc[picks]


def request_slices(sample: pd.DataFrame, pid: int, end_s: float) -> list[dict[str, Any]]:
    """Each sampled request on its own thread: arrival to finish (or the run's end), split at
    its first token."""
    out = []
    for row in _records(sample):
        rid = int(row["request_id"])
        # Unfinished: until the run's end; rejected: turned away on arrival.
        stop = (row["finish_s"] if not math.isnan(row["finish_s"]) else
                row["arrival_s"] if row["status"] == "rejected" else max(end_s, row["arrival_s"]))
        first = stop if math.isnan(row["first_token_s"]) else row["first_token_s"]
        args = {"request_id": rid, "status": str(row["status"]), "reason": str(row["reason"]),
                "num_prompt_tokens": int(row["num_prompt_tokens"]),
                "num_generated_tokens": int(row["num_generated_tokens"]),
                "ttft_ms": _ms(row["ttft_s"]), "e2e_ms": _ms(row["e2e_s"])}
        arrival = row["arrival_s"]
        out.append(_slice(pid, rid, arrival, stop, f"request {rid}", "request", args))
        out.append(_slice(pid, rid, arrival, first, "to first token", "request", {}))
        if first < stop:
            out.append(_slice(pid, rid, first, stop, "decoding", "request", {}))
    return out


def request_flow(row: dict[str, Any], spans: Spans, transfers: pd.DataFrame, link_pid: int,
                 request_pid: int) -> list[dict[str, Any]]:
    """The flow of one request: arrival, first-token iteration (disaggregated: the prefill's
    last, whichever side the client's first token came from), KV transfer, finishing
    iteration (the points it reached); none if its prompt was never computed."""
    rid = int(row["request_id"])
    prefill_end = row.get("prefill_end_s", math.nan)
    first = _iteration_mid(spans, int(row["replica_id"]),
                           row["first_token_s"] if math.isnan(prefill_end) else prefill_end)
    if first is None:
        return []
    points = [(request_pid, rid, _us(row["arrival_s"]).item()), first]
    moved = _records(transfers[transfers["request_id"] == rid])
    if moved:
        t = moved[0]
        points.append((link_pid, int(t["replica_id"]),
                       _us((t["wire_start_s"] + t["transfer_end_s"]) / 2).item()))
    decode = int(row["decode_replica_id"])
    last = _iteration_mid(spans, decode if decode >= 0 else int(row["replica_id"]),
                          row["finish_s"])
    if last is not None and last != first:
        points.append(last)
    phases = ["s"] + ["t"] * (len(points) - 2) + ["f"]
    return [{"ph": ph, "pid": pid, "tid": tid, "ts": ts, "id": rid, "cat": "request",
             "name": "request", **({"bp": "e"} if ph != "s" else {})}
            for ph, (pid, tid, ts) in zip(phases, points, strict=True)]


def _iteration_mid(spans: Spans, replica_id: int, time_s: float
                   ) -> tuple[int, int, float] | None:
    """The middle of the iteration of `replica_id` that ended at `time_s` (a token's time), as
    a flow point on that slice's thread: inside the slice, clear of the edges it shares with
    its neighbours. (Iterations end in the order they started, pipelined or not.)"""
    if replica_id not in spans or math.isnan(time_s):
        return None
    start, end, tracks = spans[replica_id]
    k = int(np.searchsorted(end, time_s))
    if k >= len(end) or end[k] != time_s:
        return None
    return (replica_id + 1, int(tracks[k]),
            round((_us(start[k]).item() + _us(end[k]).item()) / 2, 3))


def _slice(pid: int, tid: int, start_s: float, end_s: float, name: str, cat: str,
           args: dict[str, Any]) -> dict[str, Any]:
    ts = _us(start_s).item()
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": round(_us(end_s).item() - ts, 3),
            "cat": cat, "name": name, "args": args}


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts of plain Python values (NaN stays a float)."""
    return [{str(k): v for k, v in row.items()} for row in df.to_dict("records")]


def _meta(kind: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {key: value}}


def _track_name(track: int) -> str:
    """Thread 0 holds a replica's iterations; thread k > 0 those sent while threads 0 to k-1
    were all busy (k or more in flight)."""
    return "iterations" if track == 0 else f"iterations (in flight {track + 1})"


def _kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    if num_prefill_tokens and num_decode_tokens:
        return "prefill+decode"
    return "prefill" if num_prefill_tokens else "decode" if num_decode_tokens else "empty"


def _us(seconds: Any) -> np.ndarray:
    return np.round(np.asarray(seconds, dtype=np.float64) * US, 3)


def _ms(seconds: float) -> float | None:
    return None if seconds != seconds else round(float(seconds) * 1e3, 6)
