"""Several variants of one scenario, run on the same trace and compared in one table.

A comparison file holds a `base` scenario and named `variants`, each a partial scenario merged
into the base: mappings merge key by key, except that a mapping naming another registry entry
(`name`, `kind` or `format`: another scheduler, say) replaces the base's whole; anything else
replaces."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from sim.config.errors import InputError
from sim.config.overrides import (
    Override,
    apply_overrides,
    named_by_overrides,
    problems_alone,
    resolved_defaults,
    split_base_problems,
)
from sim.config.scenario import (
    Scenario,
    merge_mappings,
    name_problem,
    parse_scenario,
    read_mapping,
    results_name,
)
from sim.config.yaml_input import read_base
from sim.results.outdir import (
    PLOTS_DIR,
    REPORT_FILE,
    check_out_dir,
    check_writable_dir,
    is_run_dir,
    replace_file,
)
from sim.results.run_dir import Results
from sim.runner import run_scenario
from sim.studies.replications import COMPARISON_TABLES, check_only_comparison_entries
from sim.workloads.load import load_workload

TABLE = "comparison.csv"
# What a comparison (plain or replicated) writes beside its variants' folders, and what `plot`
# and `report` write there: no variant may be named so.
OWN_ENTRIES = frozenset({*COMPARISON_TABLES, PLOTS_DIR, REPORT_FILE})


def load_comparison(path: str | Path, overrides: Sequence[Override] = ()
                    ) -> dict[str, Scenario]:
    """Each variant of a comparison file as a full scenario, named `<name>/<variant>`;
    `overrides` (`--set`) set in every variant, over the base and the variant's changes. The
    base is a scenario mapping or, as a sweep's, a scenario file (relative to the comparison
    file; its own relative paths then to it)."""
    path = Path(path)
    data = read_mapping(path, "comparison", {"name", "base", "variants"})
    base, base_dir, base_file = read_base(path, data)
    variants = data.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise InputError(path, "variants", variants, "must map names to scenario changes")
    name = results_name(path, data)
    if any(dotted == "name" for dotted, _ in overrides):
        raise InputError(path, "--set name", name, "a comparison names its variants "
                         "<name>/<variant>: change the file's name instead")
    scenarios = {}
    for variant, change in variants.items():
        if not isinstance(change, dict):
            raise InputError(path, f"variants.{variant}", change, "must be a mapping")
        # A variant's results go to <out>/<variant>/: one folder, not a path below it.
        if "/" in variant or name_problem(variant):
            raise InputError(path, "variants", variant, "a variant's name is its results' "
                             "folder: use letters (any script), digits and _ . - + =, not "
                             "starting with '.', no '/'")
        if str(variant).casefold() in OWN_ENTRIES:  # casefold: macOS's file system
            raise InputError(path, "variants", variant, "the comparison's own file or folder "
                             f"beside its variants ({', '.join(sorted(OWN_ENTRIES))}) has that "
                             "name: rename the variant")
        if "name" in change:
            raise InputError(path, f"variants.{variant}.name", change["name"],
                             f"a variant is named {name}/{variant} by the comparison: leave "
                             "name out (change the file's name, or the variant's key)")
        merged = merge_mappings(base, {**change, "name": f"{name}/{variant}"})
        if overrides:
            defaults = resolved_defaults(merged, path, base_dir)
            merged = apply_overrides(merged, overrides, defaults)
        try:
            scenarios[str(variant)] = parse_scenario(merged, path, base_dir)
        except InputError as exc:  # each field within its variant, or named by its --set
            if base_file is not None:  # the base file's own problems: named by it
                own, _ = split_base_problems(exc, problems_alone(
                    {"name": name, **base}, base_file, base_dir), overrides)
                if own:
                    raise InputError.many(base_file, own) from None
            prefix = f"variants.{variant}."
            raise named_by_overrides(exc, overrides, path, prefix.__add__) from None
    return scenarios


def compare(scenarios: dict[str, Scenario], out_dir: Path | None = None, *,
            on_variant: Callable[[str, Results], None] | None = None,
            workloads_checked: bool = False) -> tuple[pd.DataFrame, dict[str, Results]]:
    """Run every variant (`on_variant(name, results)` after each); one row per variant with
    its overload verdict and headline numbers. With `out_dir`, each variant's results go to
    `out_dir/<variant>/` and the table to `comparison.csv`, written only once every variant
    is done (an earlier table is removed first: it would look current). Every variant's
    workload is read first (`check_workloads`), unless the caller has (`workloads_checked`)."""
    if len(scenarios) > 1 and not workloads_checked:
        check_workloads(scenarios)
    if out_dir is not None:
        check_comparison_dir(out_dir, scenarios)
        (out_dir / TABLE).unlink(missing_ok=True)
    results = {}
    for variant, scenario in scenarios.items():
        results[variant] = run_scenario(
            scenario, out_dir=None if out_dir is None else out_dir / variant)
        if on_variant is not None:
            on_variant(variant, results[variant])
    table = pd.DataFrame([row(variant, res) for variant, res in results.items()])
    if out_dir is not None:
        replace_file(out_dir / TABLE, lambda tmp: table.to_csv(tmp, index=False))
    return table, results


def check_workloads(scenarios: dict[str, Scenario]) -> None:
    """Read every variant's requests before any variant runs: a variant whose workload is
    bad (a time window holding no request, a trace it cannot read) fails the comparison
    before a run is written, rather than after the variants before it (a comparison is
    kept whole or not at all). A problem of the comparison file's is named within its
    variant (`variants.<variant>.workload...`)."""
    for variant, scenario in scenarios.items():
        try:
            load_workload(scenario)
        except InputError as exc:
            if exc.source != scenario.source:  # the trace's own problem: named by the trace
                raise
            prefix = f"variants.{variant}."
            raise InputError.many(exc.source, [(prefix + field, value, problem) for
                                               field, value, problem in exc.problems]) from None


def check_comparison_dir(out_dir: Path, variants: Iterable[str]) -> None:
    """Fail before any run if a variant's results could not be written (`out_dir` a file, a
    single run's directory, a variant's directory holding something else, unwritable), or
    if `out_dir` holds anything that is not an earlier comparison's."""
    check_writable_dir(out_dir)
    if is_run_dir(out_dir):
        raise InputError(out_dir, "--out", str(out_dir), "holds a single run's results; "
                         "choose another directory for a comparison")
    for variant in variants:
        check_out_dir(out_dir / variant)
    check_only_comparison_entries(out_dir)


# Per request class (`workload.classes`): columns `class:<name>:<key>`, after the others.
CLASS_KEYS = ("ttft_p99_s", "slo_attainment")


def row(variant: str, res: Results) -> dict[str, Any]:
    s = res.summary
    transfer = s.get("transfer", {}).get("transfer_s", {})
    offload = s.get("kv_offload") or {}
    per_class = {}
    for c in s.get("classes") or []:
        per_class[f"class:{c['name']}:ttft_p99_s"] = c["ttft_s"]["p99"]
        per_class[f"class:{c['name']}:slo_attainment"] = c["slo"].get("all_attainment")
    return {
        "variant": variant,
        "pools": "+".join(f"{n}{p[0].upper()}" if p != "colocated" else f"{n}x"
                          for p, n in s["run"]["pools"].items()),
        "scheduler": s["run"]["scheduler"],
        "overload": (s.get("overload") or {}).get("verdict"),
        "finished": s["requests"]["finished"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tbt_p50_s": s["tbt_s"]["p50"],
        "tbt_p99_s": s["tbt_s"]["p99"],
        "e2e_p99_s": s["e2e_s"]["p99"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "slo_attainment": s["slo"].get("all_attainment"),
        "transfer_p99_s": transfer.get("p99"),
        "num_gpus": (s.get("cost") or {}).get("num_gpus"),
        "usd_per_million_tokens": (s.get("cost") or {}).get("usd_per_million_tokens"),
        "num_preemptions": s["num_preemptions"],
        "parallelism": s["run"].get("parallelism"),  # later: earlier columns keep their places
        "failed": s["requests"].get("failed", 0),  # its client gave up (workload.timeout_s)
        "tpot_p50_s": s["tpot_s"]["p50"],
        # Speculative decoding: tokens a decode step yields (vLLM's acceptance length).
        "acceptance_length": (s.get("speculative") or {}).get("acceptance_length"),
        # Disaggregated: whether the first token came before the hand-off (the prefill's).
        "first_token_from": s.get("transfer", {}).get("first_token_from"),
        # Prefix caching: prompt tokens found cached, in any tier; with a host tier (vLLM's
        # CPU tier, SGLang's hierarchical cache), the share loaded from it and a load's mean
        # time (`summary.kv_offload`).
        "prefix_hit_rate": (s.get("prefix_cache") or {}).get("hit_rate_tokens"),
        "cpu_hit_rate": offload.get("hit_rate_tokens", {}).get("cpu"),
        "mean_load_s": offload.get("mean_load_s"),
        **per_class,
    }
