"""A run's iterations over a window of time: tokens per iteration of one replica per pool
(prefill and decode pools both, when disaggregated), KV blocks in use and queue lengths."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sim.config.errors import COMMAND_LINE, InputError
from sim.plots.common import legend, save
from sim.results.run_dir import Results

WINDOW_S = 5.0  # the default window's length


def busiest_window(its: pd.DataFrame, length_s: float = WINDOW_S) -> tuple[float, float]:
    """The `length_s` window starting at an iteration's start that holds the most tokens
    (prefill and decode, iterations by their start); the earliest of equals."""
    if its.empty:
        return 0.0, length_s
    order = its.sort_values("start_s", kind="stable")
    start = order["start_s"].to_numpy()
    tokens = (order["num_prefill_tokens"] + order["num_decode_tokens"]).to_numpy()
    total = np.concatenate([[0], np.cumsum(tokens)])
    end = np.searchsorted(start, start + length_s, side="left")
    best = int(np.argmax(total[end] - total[np.arange(len(start))]))
    return float(start[best]), float(start[best]) + length_s


def chosen_replicas(its: pd.DataFrame, replicas: Sequence[int] | None, source: Path
                    ) -> list[int]:
    """The replicas drawn: those asked for, else the first of each pool."""
    present = sorted(int(r) for r in its["replica_id"].unique())
    if replicas:
        absent = [r for r in replicas if r not in present]
        if absent:
            raise InputError(source, "--replica", absent,
                             f"no such replica (this run has {present})")
        return list(dict.fromkeys(replicas))
    firsts = its.groupby("pool", sort=False)["replica_id"].min()
    return sorted(int(r) for r in firsts)


def _pool(its: pd.DataFrame, replica: int) -> str:
    pools = its.loc[its["replica_id"] == replica, "pool"]
    return str(pools.iloc[0]) if len(pools) else ""


def iteration_timeline(run: Results, path: Path, replica_id: int | Sequence[int] | None = None,
                       window_s: tuple[float, float] | None = None) -> list[Path]:
    """Each iteration's prefill and decode tokens over the window (default: the busiest
    `WINDOW_S` seconds), one panel per replica (default: the first of each pool), then each
    replica's share of KV blocks in use and its waiting queue and running requests (those in
    its iterations in progress: `requests_in_flight`). The run is read (and checked) by the
    caller: `Results.load`."""
    its = run.iterations
    ids = [replica_id] if isinstance(replica_id, int) else replica_id
    replicas = chosen_replicas(its, ids, (run.path or Path(".")) / "iterations.parquet")
    mine = its[its["replica_id"].isin(replicas)]
    busiest = window_s is None
    if window_s is None:
        window_s = busiest_window(mine)
    shown = mine[(mine["start_s"] + mine["duration_s"] > window_s[0])
                 & (mine["start_s"] < window_s[1])]
    if not busiest and shown.empty:
        span = (f"{float(mine['start_s'].min()):.1f} to "
                f"{float((mine['start_s'] + mine['duration_s']).max()):.1f} s"
                if len(mine) else "none")
        raise InputError(COMMAND_LINE, "--window", f"{window_s[0]:g}:{window_s[1]:g}",
                         f"holds no iteration of the replicas shown (they run {span})")
    about = run.summary.get("run") or {}
    blocks = about.get("num_kv_blocks") if isinstance(about.get("num_kv_blocks"), int) else None
    fig, axes = plt.subplots(len(replicas) + 2, 1, figsize=(10, 2.1 * (len(replicas) + 2)),
                             sharex=True, squeeze=False)
    axes = axes[:, 0]
    for k, (ax, replica) in enumerate(zip(axes, replicas, strict=False)):
        _tokens(ax, shown[shown["replica_id"] == replica], f"{_pool(its, replica)} replica "
                f"{replica}".strip())
        if k == 0:
            legend(ax)
    for i, replica in enumerate(replicas):
        everything = mine[mine["replica_id"] == replica]
        running = pd.Series(requests_in_flight(everything), index=everything.index)
        part = shown[shown["replica_id"] == replica].sort_values("start_s")
        name = f"{_pool(its, replica)} {replica}".strip()
        kv = part["num_kv_blocks_used"] / blocks if blocks else part["num_kv_blocks_used"]
        axes[-2].step(part["start_s"], 100 * kv if blocks else kv, where="post",
                      color=f"C{i + 2}", label=name)
        axes[-1].step(part["start_s"], part["num_waiting"], where="post", color=f"C{i + 2}",
                      label=f"{name}: waiting")
        axes[-1].step(part["start_s"], running[part.index], where="post", color=f"C{i + 2}",
                      linestyle=":", label=f"{name}: running")
    axes[-2].set(ylabel="KV in use (%)" if blocks else "KV blocks in use", title="KV cache")
    axes[-1].set(ylabel="requests", xlabel="time (s)", title="queue and batch")
    legend(axes[-2])
    legend(axes[-1])
    axes[-1].set_xlim(*window_s)
    fig.suptitle(f"iterations, {window_s[0]:.1f} to {window_s[1]:.1f} s"
                 + (" (the busiest window)" if busiest else ""))
    return save(fig, path)


def requests_in_flight(its: pd.DataFrame) -> np.ndarray:
    """At each iteration's start, the requests in the iterations of its replica in progress
    then: that iteration's own where iterations follow one another; on a pipelined replica,
    which keeps several in flight (one per stage, each with its own requests), their sum (a
    prompt whose next chunk is sent before its last one ends counts in both). Plotting each
    iteration's own count there would zig-zag between the micro-batches."""
    start = its["start_s"].to_numpy(np.float64)
    end = start + its["duration_s"].to_numpy(np.float64)  # the engine's own end, bit for bit
    seqs = its["num_seqs"].to_numpy(np.int64)
    by_start, by_end = np.argsort(start, kind="stable"), np.argsort(end, kind="stable")
    started = np.concatenate(([0], np.cumsum(seqs[by_start])))
    ended = np.concatenate(([0], np.cumsum(seqs[by_end])))
    # Started at or before this start, less ended at or before it (the one before ends
    # exactly when the next starts, where nothing overlaps).
    return (started[np.searchsorted(start[by_start], start, side="right")]
            - ended[np.searchsorted(end[by_end], start, side="right")])


def _tokens(ax: Any, part: pd.DataFrame, title: str) -> None:
    ax.bar(part["start_s"], part["num_decode_tokens"], width=part["duration_s"], align="edge",
           label="decode tokens", color="tab:blue")
    below = part["num_decode_tokens"]
    if "num_spec_tokens" in part:  # speculative decoding: the drafts the decodes verified
        ax.bar(part["start_s"], part["num_spec_tokens"], width=part["duration_s"],
               align="edge", bottom=below, label="draft tokens verified", color="tab:green")
        below = below + part["num_spec_tokens"]
    ax.bar(part["start_s"], part["num_prefill_tokens"], width=part["duration_s"],
           align="edge", bottom=below, label="prefill tokens", color="tab:orange")
    ax.set(ylabel="tokens / iteration", title=title)
