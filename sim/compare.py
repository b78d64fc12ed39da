"""Several variants of one scenario, run on the same trace and compared in one table.

A comparison file holds a `base` scenario and named `variants`, each a partial scenario merged
into the base: mappings merge key by key, except that a mapping naming another registry entry
(`name`, `kind` or `format`: another scheduler, say) replaces the base's whole; anything else
replaces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from sim.config import Scenario, parse_scenario, read_mapping
from sim.errors import InputError
from sim.runner import Results, run_scenario


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and not _renamed(old, value):
            out[key] = merge(old, value)
        else:
            out[key] = value
    return out


def _renamed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return any(k in new and new[k] != old.get(k) for k in ("name", "kind", "format"))


def load_comparison(path: str | Path) -> dict[str, Scenario]:
    """Each variant of a comparison file as a full scenario, named `<name>/<variant>`."""
    path = Path(path)
    data = read_mapping(path, "comparison", {"name", "base", "variants"})
    base, variants = data.get("base"), data.get("variants")
    if not isinstance(base, dict):
        raise InputError(path, "base", base, "must be a scenario mapping")
    if not isinstance(variants, dict) or not variants:
        raise InputError(path, "variants", variants, "must map names to scenario changes")
    name = str(data.get("name", path.stem))
    scenarios = {}
    for variant, change in variants.items():
        if not isinstance(change, dict):
            raise InputError(path, f"variants.{variant}", change, "must be a mapping")
        merged = merge(base, {**change, "name": f"{name}/{variant}"})
        try:
            scenarios[str(variant)] = parse_scenario(merged, path, path.parent)
        except InputError as exc:
            raise InputError(path, f"variants.{variant}.{exc.field}", exc.value,
                             exc.problem) from None
    return scenarios


def compare(scenarios: dict[str, Scenario], out_dir: Path | None = None
            ) -> tuple[pd.DataFrame, dict[str, Results]]:
    """Run every variant; one row per variant with its headline numbers."""
    results = {}
    for variant, scenario in scenarios.items():
        results[variant] = run_scenario(
            scenario, out_dir=None if out_dir is None else out_dir / variant)
    table = pd.DataFrame([row(variant, res) for variant, res in results.items()])
    if out_dir is not None:
        table.to_csv(out_dir / "comparison.csv", index=False)
    return table, results


def row(variant: str, res: Results) -> dict[str, Any]:
    s = res.summary
    transfer = s.get("transfer", {}).get("transfer_s", {})
    return {
        "variant": variant,
        "pools": "+".join(f"{n}{p[0].upper()}" if p != "colocated" else f"{n}x"
                          for p, n in s["run"]["pools"].items()),
        "scheduler": s["run"]["scheduler"],
        "finished": s["requests"]["finished"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tbt_p50_s": s["tbt_s"]["p50"],
        "tbt_p99_s": s["tbt_s"]["p99"],
        "e2e_p99_s": s["e2e_s"]["p99"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "slo_attainment": s["slo"].get("all_attainment"),
        "transfer_p99_s": transfer.get("p99"),
        "num_preemptions": s["num_preemptions"],
    }
