"""What `servesim validate` prints and draws: an 80-column table, the goals met or not, a figure.
Everything is read from the error frames (`errors.csv`, `iterations.csv`) and `meta.json`."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

SHORT = {"replay_2": "replay 2", "replay_3": "replay 3", "recorded": "recorded",
         "profile": "profile", "profile_host": "prof+host", "roofline": "roofline"}
TABLE_METRICS = {"ttft_p50": "TTFT50", "ttft_p99": "TTFT99", "tbt_p50": "TBT50",
                 "tbt_p99": "TBT99", "e2e_p50": "E2E50", "e2e_p99": "E2E99",
                 "sched_delay_p50": "wait50", "throughput": "tok/s"}
GOAL_METRICS = ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99")
FIGURE_COMPARED = ("replay_2", "recorded", "profile", "profile_host")
WIDTH = 80


def wrap(lines: list[str]) -> list[str]:
    """Lines of at most 80 characters (long ones continue indented)."""
    out = []
    for line in lines:
        out += textwrap.wrap(line, WIDTH, subsequent_indent="    ", break_on_hyphens=False,
                             drop_whitespace=True) or [""]
    return out


def signed_pct(value: Any) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    pct = 100 * float(value)
    return f"{pct:+.1f}" if abs(pct) < 1000 else f"{pct:+.0f}"


def failed(row: Any) -> bool:
    """The simulation of this row failed (validate said why)."""
    return str(row.get("failed")) == "True"


def header_lines(meta: dict[str, Any]) -> list[str]:
    m, p = meta["machine"], meta["profile"]
    hold = p.get("holdout") or {}
    when = "measured in this sitting" if p["measured_now"] else "given"
    r = meta["replays"]
    load = (f"load avg {r['loadavg_1m'][0]:.1f}-{r['loadavg_1m'][1]:.1f} during them"
            if r.get("loadavg_1m") else "")
    lines = [f"servesim validate, {meta['date']}",
             f"machine: {m['device_name']}, {m['cpu_count']} cores, torch {m['torch']}, "
             f"{m['torch_threads']} thread(s)",
             f"replays: {r['num']}, {r['first_date']} to {r['last_date']}; {load}",
             f"profile: {p['source']} ({when}, {p.get('date')}; held-out MAPE "
             f"{100 * hold.get('mape', float('nan')):.1f}%)",
             f"host overhead ({'replays 2+' if meta.get('repeats', 2) > 1 else 'replay 1'}): "
             f"median {1e3 * meta['host']['median_s']:.2f} ms, "
             f"mean {1e3 * meta['host']['mean_s']:.2f} ms per iteration"]
    lines += [f"WARNING: profile {flag}" for flag in p["flags"]]
    for label, cap in meta["capacity"].items():
        lines.append(f"capacity {label}: {cap['requests_per_s']:.3g} req/s ({cap['how']})")
    lines.append(f"command: {meta['command']}")
    return wrap(lines)


NAME_WIDTH = 6  # the tables' first column: 80 columns leave no more


def short_names(names: Any) -> dict[str, str]:
    """Each scheduler's (or scenario's) label in the tables' six-character column: as it is if
    short enough; cut if the cut ones stay apart; else the long ones cut shorter and numbered
    (`azur#1`, `azur#2`: two scenarios named `azure_conv_...` must not share a row label).
    The same mapping for every table of a sitting (sorted, whatever order a table has)."""
    labels = sorted({str(name) for name in names})
    if all(len(label) <= NAME_WIDTH for label in labels):
        return {label: label for label in labels}
    cut = {label: label[:NAME_WIDTH] for label in labels}
    if len(set(cut.values())) == len(labels):
        return cut
    long = [label for label in labels if len(label) > NAME_WIDTH]
    keep = NAME_WIDTH - 1 - len(str(len(long)))
    numbered = {label: f"{label[:keep]}#{i}" for i, label in enumerate(long, start=1)}
    return {label: numbered.get(label, label) for label in labels}


def legend(names: dict[str, str]) -> list[str]:
    """Which label a cut name stands for; nothing when none was cut."""
    cut = [f"{short} = {name}" for name, short in names.items() if short != name]
    return wrap(["names: " + ", ".join(cut)]) if cut else []


def error_table(errors: pd.DataFrame) -> list[str]:
    """Signed relative error (%) of each comparison against replay 1, per scheduler and load."""
    names = short_names(errors["scheduler"])
    lines = ["", "signed error vs replay 1, % (replay 2: run-to-run variation, the floor)",
             *legend(names),
             f"{'sched':<6}{'load':>5} {'vs':<10}"
             + "".join(f"{name:>7}" for name in TABLE_METRICS.values())]
    last = None
    for _, row in errors.iterrows():
        key = (row["scheduler"], row["load"])
        head = (f"{names[str(row['scheduler'])]:<6}{row['load']:>5.2f} " if key != last
                else " " * 12)
        last = key
        name = f"{SHORT.get(row['compared'], row['compared'])[:10]:<10}"
        if failed(row):
            lines.append(head + name + "  (simulation failed; see the log)")
            continue
        lines.append(head + name + "".join(f"{signed_pct(row[m]):>7}" for m in TABLE_METRICS))
    return lines


def verdict_lines(errors: pd.DataFrame) -> list[str]:
    """Each point's overload verdict (replay 1's), and every run whose verdict differs: near
    capacity a point is overloaded, and its latencies then grow with the trace's length."""
    lines = ["", "overload verdict of replay 1 (and of each run that says otherwise)"]
    names = short_names(errors["scheduler"])
    for (sched, load), rows in errors.groupby(["scheduler", "load"], sort=False):
        if "reference_verdict" not in rows:
            continue
        reference = rows["reference_verdict"].iloc[0]
        differ = [f"{SHORT.get(r['compared'], r['compared'])} {r['verdict']}"
                  for _, r in rows.iterrows()
                  if not failed(r) and r["verdict"] != reference]
        lines += wrap([f"{names[str(sched)]:<6}{load:>5.2f} {reference}"
                       + (f"; otherwise: {', '.join(differ)}" if differ else "")])
    return lines


def iteration_table(iters: pd.DataFrame) -> list[str]:
    """Latency models on the iterations that ran: median signed / mean absolute error (%)."""
    lines = ["", "per-iteration error on replay 1's shapes, % (median signed / mean abs)",
             f"{'sched':<6}{'load':>5}{'iters':>6}{'host ms':>8}{'host%':>6}"
             f"{'prof/fwd':>12}{'prof/dur':>12}{'p+host/dur':>12}{'roof/dur':>12}"]
    names = short_names(iters["scheduler"])
    for _, r in iters.iterrows():
        cells = []
        for name in ("profile_vs_forward", "profile_vs_duration", "profile_host_vs_duration",
                     "roofline_vs_duration"):
            cells.append(f"{signed_pct(r[f'{name}_median_signed'])}/"
                         f"{100 * r[f'{name}_mape']:.0f}")
        lines.append(f"{names[str(r['scheduler'])]:<6}{r['load']:>5.2f}{r['num_iterations']:>6}"
                     f"{r['host_ms_median']:>8.2f}{100 * r['host_share']:>6.1f}"
                     + "".join(f"{c:>12}" for c in cells))
    return lines


def floor(errors: pd.DataFrame, scheduler: str, load: float, metric: str) -> float | None:
    """Largest |replay k vs replay 1| difference of a metric at a point."""
    rows = errors[(errors["scheduler"] == scheduler) & (errors["load"] == load)
                  & errors["compared"].str.startswith("replay_")]
    values = rows[metric].dropna().abs()
    return float(values.max()) if len(values) else None


def goal_lines(errors: pd.DataFrame) -> list[str]:
    """The issue's goals, point by point: recorded reproduces replay (same plans, per-request
    timestamps within 1%); prof+host within twice the replay-vs-replay floor."""
    lines = ["", "goals"]
    names = short_names(errors["scheduler"])
    for (sched, load), rows in errors.groupby(["scheduler", "load"], sort=False):
        rec = rows[rows["compared"] == "recorded"].iloc[0]
        prof = rows[rows["compared"] == "profile_host"].iloc[0]
        if failed(rec) or failed(prof):
            lines.append(f"{names[str(sched)]:<6}{load:>5.2f} a simulation failed: no verdict")
            continue
        worst = max(rec["max_request_ttft_error"] or 0.0, rec["max_request_e2e_error"] or 0.0)
        ok = bool(rec["same_plans"]) and worst <= 0.01
        lines.append(f"{names[str(sched)]:<6}{load:>5.2f} recorded: plans "
                     f"{'identical' if rec['same_plans'] else 'differ'}, worst request "
                     f"{100 * worst:.2g}% -> {'met' if ok else 'NOT met'}")
        misses = []
        for metric in GOAL_METRICS:
            bound = floor(errors, str(sched), float(load), metric)  # type: ignore[arg-type]
            value = prof[metric]
            if bound is None or value is None or not np.isfinite(value):
                misses.append(f"{TABLE_METRICS[metric]} ?")
            elif abs(value) > 2 * bound:
                misses.append(f"{TABLE_METRICS[metric]} {signed_pct(value)} > 2x{100 * bound:.1f}")
        verdict = "met" if not misses else "NOT met: " + ", ".join(misses)
        lines += wrap([f"{'':<11} prof+host within 2x floor -> {verdict}"])
    return lines


def figure(errors: pd.DataFrame, meta: dict[str, Any], path: Path) -> None:
    """Error vs load, per scheduler (rows) and metric (columns); grey: twice the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedulers = list(dict.fromkeys(errors["scheduler"]))
    fig, axes = plt.subplots(len(schedulers), len(GOAL_METRICS), squeeze=False,
                             figsize=(3.2 * len(GOAL_METRICS), 2.8 * len(schedulers) + 0.8))
    for i, sched in enumerate(schedulers):
        rows = errors[errors["scheduler"] == sched]
        loads = sorted(rows["load"].unique())
        for j, metric in enumerate(GOAL_METRICS):
            ax = axes[i][j]
            band = [2 * 100 * (floor(errors, sched, x, metric) or 0.0) for x in loads]
            ax.fill_between(loads, [-b for b in band], band, color="0.85",
                            label="2x replay-vs-replay")
            for name in FIGURE_COMPARED:
                sel = rows[rows["compared"] == name].sort_values("load")
                if len(sel):
                    ax.plot(sel["load"], 100 * sel[metric].astype(float), marker="o",
                            label=SHORT[name])
            ax.axhline(0, color="black", linewidth=0.6)
            ax.set_title(f"{sched}: {TABLE_METRICS[metric]}", fontsize=9)
            ax.set_xlabel("load (fraction of capacity)", fontsize=8)
            ax.set_ylabel("error vs replay 1 (%)", fontsize=8)
            ax.tick_params(labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    m = meta["machine"]
    fig.suptitle(f"simulator vs replay: {meta['model']} on {m['device_name']}, "
                 f"{m['torch_threads']} thread(s), {meta['date']}\nprofile: "
                 f"{Path(meta['profile']['source']).name} "
                 f"({'this sitting' if meta['profile']['measured_now'] else 'given'}); "
                 "roofline off-scale, see table", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
