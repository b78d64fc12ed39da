"""The report's sections for replications (`simulate --replications`) and replicated
comparisons (`compare --replications`): every headline metric's estimate with its 95%
interval and the number of replications behind it, as `replications.json` states them (the
numbers the CLI prints), each replication's own values, and how the intervals were made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

import sim.report.markup as m
import sim.report.sections as s
from sim.config.errors import InputError
from sim.results.formats import DISTRIBUTIONS, PERCENTILES, THROUGHPUT
from sim.results.formats import REPLICATIONS_FILE as RESULT_FILE
from sim.results.labels import PERCENT, label, unit
from sim.results.read import read_csv, read_json

INTERVAL_HEADERS = ["metric", "unit", "estimate", "95% CI", "replications", "method"]


def read_replications(rep_dir: Path) -> dict[str, Any]:
    """`replications.json`, checked for the fields the report reads (one-line error)."""
    path = rep_dir / RESULT_FILE
    data = read_json(path)
    if not (isinstance(data.get("metrics"), dict) and isinstance(data.get("runs"), list)
            and isinstance(data.get("seeds"), list) and data["runs"] and data["seeds"]):
        raise InputError(path, "<file>", str(path),
                         "not a replications result (missing or malformed fields)")
    return data


def _rows(data: dict[str, Any]) -> list[tuple[str, str, float, dict[str, Any]]]:
    """(metric, unit, scale, interval) for each headline metric, in the CLI table's order,
    named and scaled as `sim.results.labels` names the columns they fill."""
    metrics = data["metrics"]
    rows = []
    for key in DISTRIBUTIONS:
        for stat in (*PERCENTILES, "mean"):
            if stat in metrics.get(key, {}):
                column = key if stat == "mean" else f"{key.removesuffix('_s')}_{stat}_s"
                shown = unit(column)
                name = f"mean {label(column)}" if stat == "mean" else label(column)
                rows.append((name, shown.name, shown.scale, metrics[key][stat]))
    for key in THROUGHPUT:
        if key in metrics.get("throughput", {}):
            rows.append((label(key), unit(key).name, 1.0, metrics["throughput"][key]))
    for key, metric in metrics.get("slo", {}).items():
        rows.append((label(key), PERCENT.name, PERCENT.scale, metric))
    return rows


def _interval(metric: dict[str, Any], scale: float) -> str:
    if metric.get("ci95") is None:  # every replication gave the same value
        return str(metric.get("note") or "all equal: no interval")
    lo, hi = metric["ci95"]
    if lo is None or hi is None:
        return "-"
    return f"[{m.number(scale * lo)}, {m.number(scale * hi)}]"


def interval_table(data: dict[str, Any]) -> str:
    """Each headline metric: estimate, 95% interval, how many replications gave it, method."""
    rows = []
    for name, shown, scale, metric in _rows(data):
        est = metric.get("estimate")
        rows.append([name, shown, None if est is None else scale * est,
                     _interval(metric, scale), metric.get("n"),
                     "bootstrap" if metric.get("method") == "bootstrap" else "t"])
    return m.table(INTERVAL_HEADERS, rows, text_columns={0, 1, 3, 5})


def each_replication(data: dict[str, Any]) -> str:
    """One row per replication: its seed, directory, verdict and headline values."""
    shown = {label(k) for k in ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s",
                                "e2e_p99_s", "output_tokens_per_s")}
    picked = [r for r in _rows(data) if r[0] in shown]
    verdicts = (data.get("overload") or {}).get("verdicts") or []
    rows = []
    for k, (seed, run) in enumerate(zip(data["seeds"], data["runs"], strict=False)):
        values = []
        for _, _, scale, metric in picked:
            each = metric.get("per_replication") or []
            v = each[k] if k < len(each) else None
            values.append(None if v is None else scale * v)
        rows.append([seed, run, verdicts[k] if k < len(verdicts) else "unknown", *values])
    headers = ["seed", "run", "overload", *[f"{n} ({u})" for n, u, _, _ in picked]]
    return m.table(headers, rows, text_columns={1, 2})


def how_made(data: dict[str, Any]) -> str:
    """What differs between replications, their seeds, and how each interval is made."""
    seeds = data["seeds"]
    methods = data.get("methods") or {}
    parts = [m.paragraph(f"{data.get('replications', len(seeds))} replications, seeds "
                         f"{seeds[0]}..{seeds[-1]}; they differ by: "
                         f"{', '.join(data.get('varies_by') or []) or 'nothing recorded'}."),
             m.paragraph(f"Means, throughput and SLO attainment (t): {methods.get('mean', '?')}. "
                         f"Percentiles (bootstrap): {methods.get('percentile', '?')}. "
                         "Intervals are clipped to the values a metric can take; where every "
                         "replication gave the same value no interval is stated (its spread "
                         "says nothing).")]
    cut = [n for n in ((data.get("censoring") or {}).get("ttft_all_arrived_s") or {})
           .get("num_lower_bounds", []) if n]
    if cut:
        parts.append(m.paragraph(f"TTFT is over finished requests: in {len(cut)} of "
                                 f"{len(seeds)} replications the horizon left requests "
                                 "waiting, so it is biased low (replications.json: censoring)."))
    return "\n".join(parts)


def verdicts(data: dict[str, Any], what: str = "replications") -> str:
    return s.verdict_counts(pd.Series((data.get("overload") or {}).get("verdicts") or [],
                                      dtype=object), what)


def run_dirs(rep_dir: Path, data: dict[str, Any]) -> list[Path]:
    return [rep_dir / str(r) for r in data["runs"]]


def replications_body(rep_dir: Path) -> list[str]:
    """The sections of replications of one scenario."""
    data = read_replications(rep_dir)
    runs = run_dirs(rep_dir, data)
    return [
        m.section("Overload verdict", verdicts(data)),
        m.section("Estimates with 95% confidence intervals", interval_table(data),
                  how_made(data), m.details(f"each replication ({len(runs)})",
                                            each_replication(data))),
        m.section("Resolved scenario", s.scenarios(
            [(f"{runs[0].name}/scenario.yaml", runs[0] / "scenario.yaml")],
            "The first replication's scenario; replication k runs it with seed + k.")),
        m.section("Inputs and versions", s.inputs_and_versions(runs)),
    ]


def replicated_comparison_body(compare_dir: Path) -> list[str]:
    """The sections of a replicated comparison: its table of estimates with intervals, then
    each variant's full interval table."""
    from sim.results.formats import REPLICATED_COMPARISON_FILE as COMPARISON_FILE

    table = read_csv(compare_dir / COMPARISON_FILE, ["variant"])
    variants = [str(v) for v in table["variant"]]
    datas = {v: read_replications(compare_dir / v) for v in variants}
    all_verdicts = pd.Series([x for d in datas.values()
                              for x in (d.get("overload") or {}).get("verdicts") or []],
                             dtype=object)
    per_variant = [m.details(f"{v}: every metric", interval_table(d) + "\n" + m.details(
        f"each replication ({len(d['runs'])})", each_replication(d))) for v, d in datas.items()]
    first = next(iter(datas.values()), None)
    runs = [r for v, d in datas.items() for r in run_dirs(compare_dir / v, d)]
    return [
        m.section("Overload verdict", s.verdict_counts(
            all_verdicts, f"replications ({len(variants)} variants)")),
        m.section("Estimates with 95% confidence intervals",
                  m.paragraph("Each cell: the estimate, its 95% interval [low, high] below "
                              "(none where every replication gave the same value)."),
                  m.frame_table(table, 1), *per_variant,
                  how_made(first) if first else ""),
        m.section("Resolved scenarios", s.scenarios(
            [(f"{v}/{d['runs'][0]}/scenario.yaml", compare_dir / v / d["runs"][0]
              / "scenario.yaml") for v, d in datas.items() if d["runs"]],
            "One per variant, its first replication's (open each below).")),
        m.section("Inputs and versions", s.inputs_and_versions(runs)),
    ]
