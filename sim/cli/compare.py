"""`servesim compare`: the variants of one scenario side by side, one run each or replicated
(then each metric's difference from the first variant, with its interval).

Interrupted (Ctrl-C), it says what it kept and exits 130; finished runs stay on disk whole,
and no table is written from a partial set of runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from sim.cli.common import (
    app,
    calibration_lines,
    console,
    fmt,
    interrupted,
    pct,
    refuse_unused,
    set_option,
)


@app.command()
def compare(
    ctx: typer.Context,
    comparison: Annotated[Path, typer.Argument(
        metavar="COMPARISON", help="comparison YAML: base + variants")],
    out: Annotated[Path | None, typer.Option(
        help="directory for each variant's results", show_default="results/<name>")] = None,
    replications: Annotated[int, typer.Option(
        min=1, help="run each variant N times (seeds SEED+0..N-1, the same for every "
                    "variant); each number with a 95% confidence interval")] = 1,
    workers: Annotated[int | None, typer.Option(
        min=1, help="replications: worker processes", show_default="one per CPU")] = None,
    set_: Annotated[list[str] | None, set_option(
        "in every variant, over the base and the variant's own changes")] = None,
) -> None:
    """Run every variant of a comparison file on the same trace; print one table."""
    from sim.config.overrides import parse_overrides
    from sim.studies.compare import compare as run_all
    from sim.studies.compare import load_comparison
    from sim.studies.progress import ProgressReport

    if replications == 1:
        refuse_unused(ctx, {"workers": "only with --replications N (N > 1)"})
    overrides = parse_overrides(set_)
    scenarios = load_comparison(comparison, overrides)
    # Each variant is named <name>/<variant>, and a name may itself hold '/' (x/y).
    variant, first = next(iter(scenarios.items()))
    name = first.name.removesuffix(f"/{variant}")
    out_dir = out if out is not None else Path("results") / name
    from sim.studies.compare import check_comparison_dir, check_workloads

    if len(scenarios) > 1:
        check_workloads(scenarios)  # before anything is written, replicated or not
    if replications > 1:
        compare_replicated(name, scenarios, replications, out_dir, workers)
        return
    from sim.studies.replications import COMPARISON_FILE

    check_comparison_dir(out_dir, scenarios)
    # An earlier replicated comparison's table would look current beside these runs.
    (out_dir / COMPARISON_FILE).unlink(missing_ok=True)
    done: list[str] = []
    try:
        with ProgressReport(f"compare {name}", "variants", total=len(scenarios)) as progress:
            def advance(variant: str, results: Any) -> None:
                done.append(variant)
                progress.update(len(done))
                verdict = results.summary.get("overload", {}).get("verdict", "unknown")
                progress.note(f"{variant}: done ({verdict})")

            table, _ = run_all(scenarios, out_dir, on_variant=advance, workloads_checked=True)
    except KeyboardInterrupt:
        raise interrupted(f"{len(done)} of {len(scenarios)} variants complete and kept in "
                          f"{out_dir}/<variant>/ ({', '.join(done) or 'none'}); comparison.csv "
                          "not written: run the comparison again") from None
    for part in comparison_tables(name, table, console.width):
        console.print(part)
    for line in calibration_lines(scenarios.values()):
        console.print(line)
    # A line each, short enough for 80 columns, and never folded inside a path.
    console.print(f"results: {out_dir}/", soft_wrap=True)
    console.print("  comparison.csv, <variant>/ (one run each)", soft_wrap=True)


def comparison_table(title: str, df: Any) -> Table:
    """One column per variant, one row per number (named by `sim.results.labels`): three variants
    with 18-character names fit 80 columns (no vertical rules). A row no variant has a value
    for (KV transfer when none is disaggregated) is left out."""
    import pandas as pd

    from sim.results.labels import label, unit

    rows = ("pools", "scheduler", "overload", "finished", "ttft_p50_s", "ttft_p99_s",
            "tbt_p50_s", "tbt_p99_s", "tpot_p50_s", "acceptance_length", "e2e_p99_s",
            "output_tokens_per_s", "slo_attainment", "prefix_hit_rate", "cpu_hit_rate",
            "mean_load_s", "transfer_p99_s", "num_gpus", "usd_per_million_tokens",
            *[c for c in df.columns if str(c).startswith("class:")])
    numbers = {"ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "tpot_p50_s",
               "acceptance_length", "e2e_p99_s",
               "output_tokens_per_s", "mean_load_s", "transfer_p99_s",
               "usd_per_million_tokens"}
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    # Labels wrap (a class's name too, character by character), not the variants' names.
    table.add_column("variant", max_width=18, overflow="fold")
    for variant in df["variant"]:
        table.add_column(str(variant), justify="right", no_wrap=True)
    for column_name in rows:
        if column_name not in df or df[column_name].isna().all():
            continue
        # A request class's row (`class:<name>:<key>`): the class's name before the label.
        key = column_name.rsplit(":", 1)[-1]
        who = f"{column_name.split(':')[1]}: " if column_name.startswith("class:") else ""
        values = df[column_name]
        shown = unit(key)
        if key in ("slo_attainment", "prefix_hit_rate", "cpu_hit_rate"):
            cells = [pct(v) for v in values]
        elif key in numbers:
            cells = [fmt(v, shown.scale) for v in values]
        elif key == "finished":
            cells = ["-" if pd.isna(v) else f"{int(v):,}" for v in values]
        elif key == "pools" and "parallelism" in df:  # "2x TP4": GPUs per replica too
            cells = [p if pd.isna(s) or set(str(s).split("/")) == {"TP1"}
                     else f"{p} {_same(s)}"
                     for p, s in zip(values, df["parallelism"], strict=True)]
        elif key == "scheduler":  # one name where both pools run the same scheduler
            cells = [_same(s) for s in values]
        else:
            cells = [str(v) for v in values]
        if key == "overload":
            cells = [f"[red]{c}[/]" if c == "overloaded" else c for c in cells]
        name = who + (label(key) if key in ("pools", "scheduler") or not shown.name else
                      f"{label(key)} {shown.name}")
        table.add_row(name, *cells)
    # A disaggregated variant whose first token came before its hand-off (the prefill's).
    handed_off = df["transfer_p99_s"].notna() if "transfer_p99_s" in df else None
    if handed_off is not None and "first_token_from" in df:
        handed_off &= df["first_token_from"] != "decode"
    if (handed_off is not None and handed_off.any()
            and "slo_attainment" in df and df["slo_attainment"].notna().any()):
        # (as `simulate` says under its latency table)
        table.caption = ("disaggregated: a request's TBT gaps include its KV hand-off (first "
                         "token to second), which the SLO attainment counts too")
        table.caption_justify = "left"
    return table


def comparison_tables(title: str, df: Any, width: int) -> list[Table]:
    """`comparison_table`, split into tables of as many variants as fit `width` side by side
    with their names whole (six variants of 18 characters: two tables of three)."""
    longest = max((len(str(v)) for v in df["variant"]), default=1)
    per = max(1, (width - 20) // (max(longest, 8) + 2))  # the labels' 18, then 2 per gap
    if len(df) <= per:
        return [comparison_table(title, df)]
    parts = range(0, len(df), per)
    return [comparison_table(f"{title} ({k + 1} of {len(parts)})",
                             df.iloc[start:start + per].reset_index(drop=True))
            for k, start in enumerate(parts)]


def _same(value: Any) -> str:
    """"a/b" for pools that differ; "a" where every pool has the same ("a/a")."""
    parts = str(value).split("/")
    return parts[0] if len(set(parts)) == 1 else str(value)


def compare_replicated(name: str, scenarios: dict[str, Any], replications: int, out_dir: Path,
                       workers: int | None) -> None:
    """`compare --replications N`: each variant N times; estimates with 95% intervals."""
    from sim.results.metrics.paired import DIFFERENCES_FILE
    from sim.results.outdir import SwappedInterrupt
    from sim.studies.progress import ProgressReport
    from sim.studies.replications import COMPARISON_FILE, compare_replications

    done: list[str] = []
    try:
        with ProgressReport(f"compare {name}, {replications} replications each", "variants",
                            total=len(scenarios)) as progress:
            def advance(variant: str, data: dict[str, Any]) -> None:
                done.append(variant)
                progress.update(len(done))
                over = sum(v == "overloaded" for v in data["overload"]["verdicts"])
                progress.note(f"{variant}: done ({over} of {replications} overloaded)")

            results = compare_replications(scenarios, replications, out_dir, workers=min(
                workers or os.cpu_count() or 1, replications), on_variant=advance)
    except SwappedInterrupt:
        raise interrupted(f"after the comparison was complete: its results are in {out_dir}/ "
                          f"(<variant>/ and {COMPARISON_FILE})") from None
    except KeyboardInterrupt:
        raise interrupted(f"{len(done)} of {len(scenarios)} variants had finished; nothing "
                          f"changed in {out_dir}/ (a replicated comparison is put in place "
                          "whole once every variant is done): run the comparison again"
                          ) from None
    console.print(replicated_comparison_table(name, results))
    if len(results) > 1:
        console.print(differences_table(name, results))
    console.print(f"results: {out_dir}/", soft_wrap=True)
    console.print(f"  {COMPARISON_FILE}, {DIFFERENCES_FILE}", soft_wrap=True)
    console.print("  <variant>/replications.json, <variant>/rep<k>/ (one run each)",
                  soft_wrap=True)


def replicated_comparison_table(title: str, results: dict[str, dict[str, Any]]) -> Table:
    """One column per variant; each cell the estimate over the 95% interval `[lo, hi]`."""
    from sim.results.labels import label, unit
    from sim.studies.replications import COMPARED

    first = next(iter(results.values()))
    table = Table(title=f"{title}: {first['replications']} replications per variant, seeds "
                        f"{first['seeds'][0]}..{first['seeds'][-1]}", caption_justify="left",
                  caption="estimate, then its 95% CI \\[lo, hi]: Student t for throughput and "
                          "SLO; for percentiles the mean of the replications' percentiles, "
                          "expanded percentile bootstrap at least as wide as t; all equal: "
                          "every replication gave the same value, no interval")
    table.add_column("metric", no_wrap=True)
    for variant in results:
        table.add_column(variant, justify="right", overflow="fold")
    for column, (section, key) in COMPARED:
        scale = unit(column).scale
        cells = []
        for data in results.values():
            metric = data["metrics"][section].get(key)
            if metric is None or metric["estimate"] is None:
                cells.append("-")
                continue
            lo, hi = metric["ci95"] or (None, None)
            interval = ("\n(all equal)" if metric["ci95"] is None else "" if lo is None
                        else f"\n[{fmt(lo, scale)}, {fmt(hi, scale)}]")
            cells.append(f"{fmt(metric['estimate'], scale)}{interval}")
        table.add_row(f"{label(column)} {unit(column).name}", *cells)
    overloaded = [sum(v == "overloaded" for v in d["overload"]["verdicts"])
                  for d in results.values()]
    table.add_row("overloaded", *(f"[red]{n} of {first['replications']}[/]" if n
                                  else f"0 of {first['replications']}" for n in overloaded))
    return table


def differences_table(title: str, results: dict[str, dict[str, Any]]) -> Table:
    """Each variant's paired difference from the first, one column per other variant."""
    from sim.results.labels import label, unit
    from sim.results.metrics.paired import paired_differences
    from sim.studies.replications import COMPARED

    rows = paired_differences(results, COMPARED)
    baseline = next(iter(results))
    table = Table(title=f"{title}: each variant minus {baseline}, replication by replication",
                  caption_justify="left",
                  caption="mean of the paired differences (the same seeds for every variant), "
                          "then its 95% Student t CI; * the CI excludes 0; all equal: every "
                          "pair differed alike, no interval")
    table.add_column("metric", no_wrap=True)
    others = list(results)[1:]
    for variant in others:
        table.add_column(f"{variant} - {baseline}", justify="right", overflow="fold")
    for column, _ in COMPARED:
        scale = unit(column).scale
        cells = []
        for variant in others:
            row = next(r for r in rows if r["variant"] == variant and r["metric"] == column)
            if row["difference"] is None:
                cells.append("-")
                continue
            interval = ("\n(all equal)" if row["lo"] is None
                        else f"\n[{fmt(row['lo'], scale)}, {fmt(row['hi'], scale)}]")
            mark = " *" if row["clear"] else ""
            cells.append(f"{row['difference'] * scale:+,.4g}{mark}{interval}")
        table.add_row(f"{label(column)} {unit(column).name}", *cells)
    return table
