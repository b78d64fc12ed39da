"""The report's sections, read from a result directory's own files: headline metrics, the
overload verdict, the kind's tables, the resolved scenario, input hashes and versions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

import sim.report.markup as m
from sim.config.engine import calibration_text
from sim.config.errors import InputError
from sim.results.labels import axis_label, capacity_interval, label, slo_targets, unit
from sim.results.read import read_csv, read_json, read_parquet

LATENCIES = ("ttft_s", "client_ttft_s", "tbt_s", "tpot_s", "e2e_s", "client_e2e_s",
             "scheduling_delay_s", "max_tbt_per_request_s")
STATS = ("mean", "p50", "p90", "p99", "max")


def class_metrics(summary: dict[str, Any]) -> str:
    """Per request class: its priority and share, requests finished of all, TTFT, TBT and
    E2E (ms) and SLO attainment against its own targets (else the run's)."""
    rows = []
    for c in summary["classes"]:
        req = c["requests"]
        targets = ", ".join(f"{k} {v:g}" for k, v in c["slo"].get("targets", {}).items())
        met = c["slo"].get("all_attainment")
        rows.append([c["name"], c["priority"], c["share"], f"{m.number(req['finished'])} / "
                     f"{m.number(req['total'])}",
                     *[None if c[key].get(stat) is None else m.MS_PER_S * c[key][stat]
                       for key, stat in (("ttft_s", "p50"), ("ttft_s", "p99"),
                                         ("tbt_s", "p99"), ("e2e_s", "p50"))],
                     targets or "-", None if met is None else 100 * met])
    return m.table(["class", "priority", "share", "finished / all", "TTFT P50 (ms)",
                    "TTFT P99 (ms)", "TBT P99 (ms)", "E2E P50 (ms)", "SLO targets (s)",
                    "SLO met (%)"], rows, text_columns={0, 3, 8})


def run_headline(summary: dict[str, Any]) -> str:
    """A run's latencies (ms) and its throughput, requests, SLO attainment and cost."""
    rows = []
    for key in LATENCIES:
        if key.startswith("client_") and key not in summary:
            continue  # results from before client-side latencies
        stats = summary.get(key) or {}
        rows.append([label(key), stats.get("count"),
                     *[None if stats.get(s) is None else m.MS_PER_S * stats[s] for s in STATS]])
    latencies = m.table(["metric", "count", *[f"{s} (ms)" for s in STATS]], rows)
    requests = summary.get("requests", {})
    throughput = summary.get("throughput", {})
    cost = summary.get("cost") or {}
    # Failed (their client gave up) shown where any did, or where the run could say so.
    kinds = ("finished", "rejected", "failed", "unfinished") if requests.get("failed") else (
        "finished", "rejected", "unfinished")
    sessions = summary.get("sessions")
    other = [
        (f"requests {' / '.join(kinds)}", "", " / ".join(
            m.number(requests.get(k)) for k in kinds)),
        *([("sessions completed / all", "", f"{m.number(sessions['num_completed'])} / "
                                            f"{m.number(sessions['num_sessions'])}")]
          if sessions else []),
        *[_quantity(k, throughput.get(k)) for k in ("requests_per_s", "output_tokens_per_s",
                                                      "span_s")],
        *[_quantity(k, v) for k, v in sorted((summary.get("slo") or {}).items())],
        *[_quantity(k, cost.get(k)) for k in ("num_gpus", "usd_per_million_output_tokens")],
        *[_quantity(k, summary.get(k)) for k in ("num_preemptions", "num_iterations")],
        *([_quantity("acceptance_length", spec.get("acceptance_length")),
           ("speculative acceptance rate", "%", spec.get("acceptance_rate"))]
          if (spec := summary.get("speculative")) else []),
    ]
    return latencies + "\n" + m.table(["quantity", "unit", "value"], other, text_columns=2)


def _quantity(key: str, value: Any) -> tuple[str, str, Any]:
    """(name, unit, value in that unit) of a result field, as `sim.results.labels` names it."""
    shown = unit(key)
    scaled = value * shown.scale if isinstance(value, int | float) and shown.scale != 1 else value
    return label(key), shown.name, scaled


def run_setup(summary: dict[str, Any]) -> str:
    run = summary.get("run") or {}
    rows = [(k, json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v)
            for k, v in sorted(run.items())]
    warmup = (summary.get("warmup") or {}).get("reason")
    cal = (summary.get("latency_model") or {}).get("calibration")
    return m.table(["field", "value"], rows, text_columns=2) + (
        m.paragraph(f"Warm-up: {warmup}") if warmup else "") + (
        m.paragraph(calibration_text(cal)) if cal else "")


def overload_verdict(summary: dict[str, Any]) -> str:
    """A run's overload verdict and its reason, as the summary states them."""
    overload = summary.get("overload") or {}
    verdict = str(overload.get("verdict", "unknown"))
    css = verdict if verdict in ("stable", "overloaded") else "unknown"
    return (f'<p class="verdict {css}"><strong>{m.escape(verdict)}</strong>: '
            f"{m.escape(str(overload.get('detail', 'no overload verdict recorded')))}</p>")


def verdict_counts(column: pd.Series, what: str) -> str:
    """`k of n <what> overloaded`, coloured by whether any is."""
    verdicts = column.astype(str)
    n_over, n = int((verdicts == "overloaded").sum()), len(verdicts)
    unknown = int((~verdicts.isin(["stable", "overloaded"])).sum())
    css = "overloaded" if n_over else ("unknown" if unknown else "stable")
    text = f"{n_over} of {n} {what} overloaded" + (f", {unknown} unknown" if unknown else "")
    return f'<p class="verdict {css}"><strong>{m.escape(text)}</strong></p>'


def sweep_tables(sweep_dir: Path) -> tuple[pd.DataFrame, str]:
    """A sweep's per-run table and, with several seeds a point, its interval table."""
    table = read_parquet(sweep_dir / "results.parquet", ["seed", "key"],
                         missing="the sweep has not finished: run it again to complete it")
    parts = []
    ci_path = sweep_dir / "results_ci.parquet"
    if ci_path.is_file():
        ci = read_parquet(ci_path, ["num_seeds"])
        parts.append("<h3>Mean over seeds, with 95% confidence intervals [low, high]</h3>")
        parts.append(m.frame_table(ci, _leading_columns(ci)))
        parts.append(m.details(f"every run ({len(table)})", m.frame_table(
            table, _leading_columns(table))))
    else:
        parts.append(m.frame_table(table, _leading_columns(table)))
    return table, "\n".join(parts)


def _leading_columns(df: pd.DataFrame) -> int:
    """How many columns on the left label rows (the varied fields, seed, key, variant)."""
    labels = 0
    for c in df.columns:
        if not (df[c].dtype == object or c in ("seed", "num_seeds") or "." in c):
            break
        labels += 1
    return max(labels, 1)


def comparison_table(compare_dir: Path) -> pd.DataFrame:
    return read_csv(compare_dir / "comparison.csv", ["variant"])


def capacity_tables(cap_dir: Path) -> tuple[dict[str, Any], str]:
    """A capacity search's answer, the decision at each rate probed, and its trials."""
    result = read_json(cap_dir / "capacity.json", missing="the capacity search has not finished")
    try:
        low, high = result.get("interval_qps") or result["ci95_qps"]
        answer = [_quantity("capacity_qps", result["capacity_qps"]),
                  (f"interval: {capacity_interval(result)}", unit("capacity_qps").name,
                   f"[{m.number(low)}, {'unbounded' if high is None else m.number(high)}]"),
                  _quantity("highest_held_qps", result.get("highest_held_qps")),
                  *[_quantity(k, result[k]) for k in ("num_gpus", "capacity_qps_per_gpu",
                                                      "usd_per_million_tokens") if k in result],
                  ("SLO targets", "", slo_targets(result["targets_s"])),
                  _quantity("replications", result.get("replications")),
                  _quantity("num_runs", result.get("num_runs"))]
        rates = [(r["qps"], r["runs"], r["decision"], r.get("reason", ""))
                 for r in result["rates"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InputError(cap_dir / "capacity.json", "<file>", str(cap_dir / "capacity.json"),
                         "not a capacity result (missing or malformed fields)") from None
    parts = [m.table(["quantity", "unit", "value"], answer, text_columns=2),
             m.paragraph(str(result.get("interval_meaning", ""))),
             "<h3>Rates probed</h3>",
             m.table([axis_label("qps"), label("num_runs"), "decision", "reason"], rates,
                     text_columns={2, 3})]
    trials_path = cap_dir / "trials.csv"
    if trials_path.is_file():
        trials = read_csv(trials_path, ["qps", "ok"])
        parts.append(m.details(f"every trial ({len(trials)})", m.frame_table(trials, 1)))
    return result, "\n".join(parts)


def scenarios(named: Sequence[tuple[str, Path]], note: str = "") -> str:
    """The resolved scenarios, as written beside the results; the first shown open."""
    parts = [m.paragraph(note)] if note else []
    for i, (name, path) in enumerate(named):
        text = path.read_text() if path.is_file() else f"(no {path.name} in {path.parent})"
        parts.append(m.details(name, m.pre(text), is_open=i == 0))
    return "\n".join(parts)


def recorded_inputs(run_dirs: Sequence[Path]) -> tuple[list[list[Any]], set[str]]:
    """Input files and the versions the runs recorded (`inputs.json`, written with every run);
    only what was recorded when they ran, never hashed again now."""
    rows: dict[tuple[str, str, str], list[Any]] = {}
    versions: set[str] = set()
    for d in run_dirs:
        path = d / "inputs.json"
        if not path.is_file():
            continue
        record = read_json(path)
        if record.get("servesim"):
            versions.add(f"servesim {record['servesim']}")
        for name, version in sorted((record.get("versions") or {}).items()):
            versions.add(f"{name} {version}")
        for item in record.get("inputs") or []:
            key = (str(item.get("field")), str(item.get("path")), str(item.get("sha256")))
            rows[key] = [*key, item.get("size_bytes")]
    return [rows[k] for k in sorted(rows)], versions


def inputs_and_versions(run_dirs: Sequence[Path]) -> str:
    """Input hashes and versions: those the runs recorded, and this report's environment."""
    rows, recorded = recorded_inputs(run_dirs)
    has_record = any((d / "inputs.json").is_file() for d in run_dirs)
    if rows:
        inputs = m.table(["field", "path", "sha256", "size (bytes)"], rows, text_columns=3)
    elif has_record:
        inputs = m.paragraph("The runs read no input files (synthetic workload, no profile).")
    else:
        inputs = m.paragraph("These results record no input hashes (written before runs "
                             "wrote inputs.json).")
    from sim.results.fingerprint import code_fingerprint, versions

    here = [("servesim (version + source hash)", code_fingerprint()),
            *versions(("matplotlib",)).items()]
    parts = ["<h3>Input files</h3>", inputs, "<h3>Versions</h3>"]
    if recorded:
        parts.append(m.paragraph("Recorded with the results: " + ", ".join(sorted(recorded))))
    parts.append(m.paragraph("This report was made with:"))
    parts.append(m.table(["package", "version"], here, text_columns=2))
    return "\n".join(parts)


def replay_measured(summary: dict[str, Any]) -> str:
    """What a `servesim replay` measured and where: its timings are the wall clock's, so another
    replay of the same scenario and seed gives other numbers (the simulated parts of a run are
    reproducible to the byte; these are not)."""
    rep = summary.get("replay") or {}
    run = summary.get("run") or {}
    said = (f"Served for real on {rep.get('device_name')} (torch {rep.get('torch')}, "
            f"{rep.get('torch_threads')} thread(s), {rep.get('dtype')}, "
            f"{rep.get('attention_backend')} attention), {rep.get('date')}. Every time here was "
            "measured on the wall clock: another replay of the same scenario and seed gives "
            "other timings, and can make other plans. The scenario's latency model was not "
            "used.")
    if run.get("complete") is False:
        said += (f" Interrupted at {rep.get('interrupted_at_s')} s: incomplete (requests not "
                 "done have the reason interrupted or after_stop).")
    rows = []
    for key, name in (("forward_s", "forward pass"), ("host_s", "host time around it"),
                      ("wake_s", "late wake-up after idling")):
        stats = rep.get(key) or {}
        rows.append([name, stats.get("count"), *[None if stats.get(x) is None
                                                 else m.MS_PER_S * stats[x] for x in STATS]])
    load = rep.get("loadavg_1m") or [None, None]
    share = rep.get("host_share")
    other = [("host share of busy time", "%", None if share is None else 100 * share),
             ("1-minute load average, start / end", "", " / ".join(map(m.number, load))),
             ("command", "", rep.get("command"))]
    return (m.paragraph(said)
            + m.table(["per iteration", "count", *[f"{x} (ms)" for x in STATS]], rows)
            + "\n" + m.table(["quantity", "unit", "value"], other, text_columns=2))
