"""Paired differences between the variants of a replicated comparison.

Every variant of `compare --replications N` runs with the same seeds: replication k of each
variant sees the same generated arrivals and lengths (and the same noise seed). So a variant's
difference from the baseline (the comparison's first variant) is best estimated pairwise: d_k =
value_k(variant) - value_k(baseline) for each replication k, then the mean of the d_k with a
Student t interval (N - 1 degrees of freedom) -- the method of common random numbers (Law,
"Simulation Modeling and Analysis", paired-t confidence interval). The common arrivals make the
pairs' values move together, so the differences spread less than either variant's values and
the interval is narrower than one read off two separate intervals; overlapping per-variant
intervals do not mean the difference is unclear.

A difference whose interval excludes 0 is marked `clear`. Where every pair differs by the same
amount (to rounding) no interval is stated, as for the per-variant estimates. Replications
where either side has no value (e.g. no request produced two tokens) are left out of the pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DIFFERENCES_FILE = "comparison_differences.csv"


def paired_differences(done: dict[str, dict[str, Any]],
                       compared: Sequence[tuple[str, tuple[str, str]]]
                       ) -> list[dict[str, Any]]:
    """One row per (variant other than the first, compared metric): `variant`, `baseline`,
    `metric` (a `COMPARED` column name), `difference` (mean of the paired differences, the
    metric's own unit), `lo`, `hi` (95% t interval; None where all pairs are equal),
    `num_pairs`, `clear` (the interval excludes 0)."""
    from sim.results.metrics.intervals import t_interval

    variants = list(done)
    baseline = variants[0]
    rows = []
    for variant in variants[1:]:
        for column, (section, key) in compared:
            base = _values(done[baseline], section, key)
            other = _values(done[variant], section, key)
            pairs = [(o - b) for b, o in zip(base, other, strict=True)
                     if b is not None and o is not None]
            row: dict[str, Any] = {"variant": variant, "baseline": baseline, "metric": column,
                                   "difference": None, "lo": None, "hi": None,
                                   "num_pairs": len(pairs), "clear": None}
            if pairs:
                mean, lo, hi = t_interval(pairs)  # no interval where all pairs are equal
                row.update(difference=mean, lo=lo, hi=hi,
                           clear=None if lo is None or hi is None else bool(lo > 0 or hi < 0))
            rows.append(row)
    return rows


def _values(data: dict[str, Any], section: str, key: str) -> list[float | None]:
    """The per-replication values of one metric, in replication order."""
    metric = data["metrics"][section].get(key) or {}
    return list(metric.get("per_replication") or [None] * int(data["replications"]))
