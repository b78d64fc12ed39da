"""One table of names and units for what servesim reports, shared by CLI tables, comparisons,
sweeps, capacity searches and figures, so that a number is called the same everywhere.

Terms (one name each, used by every label):

- **TTFT**: time to first token, from a request's arrival to its first output token.
- **TBT**: time between tokens, the gap between two consecutive output tokens of one request.
  vLLM's benchmarks call it ITL (inter-token latency). "P99 TBT" is the 99th percentile of
  every gap of every request, pooled (`tbt_s` in `summary.json`), not of a per-request figure.
- **worst TBT per request**: a request's largest gap (`max_tbt_per_request_s`).
- **TPOT**: time per output token, a request's *mean* gap ((E2E - TTFT) / (outputs - 1)).
- **E2E**: arrival to last token. **scheduling delay**: arrival to first scheduled.

Keys are the names in result files: `summary.json` sections (`ttft_s`), table columns
(`ttft_p99_s`, `output_tokens_per_s`, with `_lo`/`_hi` for an interval's ends) and scenario
fields by dotted path (`replica.scheduler.token_budget`). An unknown key is shown as itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple


class Unit(NamedTuple):
    """A unit's name and the factor from the stored value (seconds, fractions) to it."""

    name: str
    scale: float


MS, SECONDS, NONE = Unit("ms", 1e3), Unit("s", 1.0), Unit("", 1.0)
PERCENT = Unit("%", 100.0)

# Distributions (summary.json sections; table columns add `_p50` etc. before `_s`).
DISTRIBUTIONS: dict[str, tuple[str, Unit]] = {
    "ttft": ("TTFT", MS),
    "ttft_all_arrived": ("TTFT (every arrived request)", MS),
    "client_ttft": ("TTFT, client-side", MS),
    "client_e2e": ("E2E latency, client-side", SECONDS),
    "tbt": ("TBT", MS),
    "max_tbt_per_request": ("worst TBT per request", MS),
    "max_tbt": ("worst TBT per request", MS),
    "tpot": ("TPOT", MS),
    "e2e": ("E2E latency", SECONDS),
    "scheduling_delay": ("scheduling delay", MS),
    "scheduling_delay_all_arrived": ("scheduling delay (every arrived request)", MS),
    "sched_delay": ("scheduling delay", MS),
    "transfer": ("KV transfer time", MS),
}

# Everything else: table columns and result fields that are not distributions.
METRICS: dict[str, tuple[str, Unit]] = {
    "requests_per_s": ("throughput", Unit("req/s", 1.0)),
    "output_tokens_per_s": ("output throughput", Unit("tokens/s", 1.0)),
    "requests_per_s_per_gpu": ("throughput per GPU", Unit("req/s", 1.0)),
    "output_tokens_per_s_per_gpu": ("output throughput per GPU", Unit("tokens/s", 1.0)),
    "usd_per_million_tokens": ("cost", Unit("$/M tokens", 1.0)),
    "usd_per_million_output_tokens": ("cost", Unit("$/M output tokens", 1.0)),
    "num_gpus": ("GPUs", NONE),
    "acceptance_length": ("acceptance length", Unit("tokens/step", 1.0)),
    "slo_attainment": ("SLO attainment", PERCENT),
    # Shares of the prompt tokens admitted: found cached in any tier / loaded from the host's.
    "prefix_hit_rate": ("prefix hits", PERCENT),
    "cpu_hit_rate": ("host-tier hits", PERCENT),
    "mean_load_s": ("host-tier load", MS),  # a load's mean time
    "all_attainment": ("SLO attainment", PERCENT),
    "ttft_attainment": ("TTFT SLO attainment", PERCENT),
    "tbt_attainment": ("TBT SLO attainment (worst gap per request)", PERCENT),
    "tbt_gap_attainment": ("TBT SLO attainment (every gap)", PERCENT),
    "finished": ("finished requests", NONE),
    "rejected": ("rejected requests", NONE),
    "unfinished": ("unfinished requests", NONE),
    "failed": ("failed requests (client timeout)", NONE),
    "overload": ("overload verdict", NONE),
    "num_preemptions": ("preemptions", NONE),
    "capacity_qps": ("capacity", Unit("req/s", 1.0)),
    "capacity_qps_per_gpu": ("capacity per GPU", Unit("req/s", 1.0)),
    "highest_held_qps": ("highest rate held", Unit("req/s", 1.0)),
    "qps": ("arrival rate", Unit("req/s", 1.0)),
    "rate_scale": ("load", Unit("x trace rate", 1.0)),
    "rate": ("searched knob value", NONE),  # capacity trials: qps, or the trace rate_scale
    "ok": ("met the SLO", NONE),
    "violations": ("targets missed", NONE),
    "seed": ("seed", NONE),
    "num_seeds": ("seeds", NONE),
    "num_overloaded": ("overloaded runs", NONE),
    "replications": ("replications", NONE),
    "overloaded_replications": ("overloaded replications", NONE),
    "num_runs": ("runs", NONE),
    "num_iterations": ("iterations", NONE),
    "span_s": ("span of the run", SECONDS),  # a simulation's or a replay's (wall clock)
}

# Scenario fields by dotted path, as sweeps vary them.
PARAMS: dict[str, tuple[str, Unit]] = {
    "workload.rate_scale": ("load", Unit("x trace rate", 1.0)),
    "workload.token_scale": ("token scale", Unit("x recorded", 1.0)),
    "workload.arrivals.qps": ("arrival rate", Unit("req/s", 1.0)),
    "workload.arrivals.cv": ("arrival CV", NONE),
    "workload.num_requests": ("requests", NONE),
    "replica.scheduler": ("scheduler", NONE),
    "replica.scheduler.token_budget": ("token budget", Unit("tokens", 1.0)),
    "replica.scheduler.chunk_size": ("chunk size", Unit("tokens", 1.0)),
    "replica.scheduler.chunked_prefill_size": ("chunked prefill size", Unit("tokens", 1.0)),
    "replica.scheduler.max_num_batched_tokens": ("token budget", Unit("tokens", 1.0)),
    "replica.scheduler.max_num_seqs": ("max running requests", NONE),
    "replica.gpu": ("GPU", NONE),
    "replica.model": ("model", NONE),
    "replica.prefix_caching": ("prefix caching", NONE),
    "replica.kv_cache.block_size": ("KV block size", Unit("tokens", 1.0)),
    "replica.kv_cache.num_blocks": ("KV blocks", NONE),
    "cluster.replicas": ("replicas", NONE),
    "cluster.router": ("router", NONE),
    "cluster.link.bandwidth_gb_s": ("KV link bandwidth", Unit("GB/s", 1.0)),
    "seed": ("seed", NONE),
}

# Fields a sweep's "load" axis is made of (the x axis of latency-vs-load figures).
LOAD_PARAMS = ("workload.rate_scale", "workload.arrivals.qps", "qps")

SCHEDULERS = {"chunked_prefill": "chunked prefill", "prefill_first": "prefill-first",
              "vllm_v1": "vLLM v1", "sglang": "SGLang"}
# A scheduler's parameter worth naming in a legend, in order of preference.
KEY_PARAMETERS = {"token_budget": "budget", "max_num_batched_tokens": "budget",
                  "chunked_prefill_size": "chunk", "chunk_size": "chunk",
                  "max_num_seqs": "max seqs"}

_PERCENTILE = re.compile(r"^(?P<base>.+)_p(?P<p>\d+)_s(?P<end>_lo|_hi)?$")


def _lookup(key: str) -> tuple[str, Unit] | None:
    """Label and unit of `key` before percentile or interval decoration."""
    if key in METRICS:
        return METRICS[key]
    if key in PARAMS:
        return PARAMS[key]
    base = key.removesuffix("_s")
    return DISTRIBUTIONS.get(base)


def _parse(key: str) -> tuple[str, Unit, str]:
    """(label, unit, interval end) of any known key; unknown: the key itself, no unit."""
    match = _PERCENTILE.match(key)
    if match and match["base"] in DISTRIBUTIONS:
        name, unit = DISTRIBUTIONS[match["base"]]
        end = {"_lo": ", 95% CI low", "_hi": ", 95% CI high"}.get(match["end"] or "", "")
        return f"P{match['p']} {name}", unit, end
    for end_key, end in (("_lo", ", 95% CI low"), ("_hi", ", 95% CI high")):
        if key.endswith(end_key) and _lookup(key.removesuffix(end_key)):
            name, unit = _lookup(key.removesuffix(end_key))  # type: ignore[misc]
            return name, unit, end
    found = _lookup(key)
    return (found[0], found[1], "") if found else (key, NONE, "")


def label(key: str) -> str:
    """The name of a metric or field: `ttft_p99_s` -> "P99 TTFT"."""
    name, _, end = _parse(key)
    return name + end


def unit(key: str) -> Unit:
    """The unit `key` is shown in and the factor to it: `tbt_p99_s` -> Unit("ms", 1000.0)."""
    return _parse(key)[1]


def axis_label(key: str, shown: Unit | None = None) -> str:
    """An axis or column heading: `ttft_p99_s` -> "P99 TTFT (ms)"; `shown` overrides the unit."""
    name = label(key)
    u = shown or unit(key)
    return f"{name} ({u.name})" if u.name else name


def param_label(path: str) -> str:
    """A varied scenario field by its meaning: `replica.scheduler.token_budget` ->
    "token budget (tokens)"; an unknown path by its last part."""
    if path in PARAMS or _parse(path)[0] != path:
        return axis_label(path)
    return path.rsplit(".", 1)[-1].replace("_", " ")


def is_load(path: str) -> bool:
    """Whether varying `path` changes the offered load (the x axis of latency-vs-load)."""
    return path in LOAD_PARAMS


def time_unit(max_seconds: float) -> Unit:
    """Milliseconds up to 10 s, seconds beyond: a figure's axis stays readable."""
    return SECONDS if max_seconds >= 10.0 else MS


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def variant_label(value: Any) -> str:
    """A scheduler (or any mapping, or its JSON text in a sweep table) by its own names:
    {"name": "chunked_prefill", "token_budget": 2048} -> "chunked prefill, budget 2048"; a
    number as `%g`; anything else as text."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    if not isinstance(value, Mapping):
        return _number(value)
    if "peak_bf16_flops" in value or "base" in value:  # a GPU described inline: its name
        return str(value.get("name") or f"{value.get('base')}-custom")
    if "name" not in value:
        return ", ".join(f"{k.replace('_', ' ')} {_number(v)}" for k, v in value.items())
    name = SCHEDULERS.get(str(value["name"]), str(value["name"]).replace("_", " "))
    for key, short in KEY_PARAMETERS.items():
        if value.get(key) is not None:
            return f"{name}, {short} {_number(value[key])}"
    return name


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key putting numbers inside text in numeric order ("budget 256" before "2048")."""
    parts = re.split(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)", text)
    return tuple((1, float(p), "") if i % 2 else (0, 0.0, p) for i, p in enumerate(parts))


def capacity_interval(result: Mapping[str, Any]) -> str:
    """What a capacity search's interval is, in a few words, from its own record
    (`deterministic`, `replications`, `confidence`, or else `interval_meaning`'s opening): a
    deterministic replay's is the bisection's bracket, not a confidence interval."""
    meaning = str(result.get("interval_meaning") or "")
    if result.get("deterministic") or meaning.startswith("deterministic"):
        return "bisection bracket [rate held, rate failed]"
    if result.get("replications") == 1 or meaning.startswith("one replication"):
        return "one seed's bracket (no confidence stated)"
    level = result.get("confidence")
    return (f"{100 * float(level):g}% confidence bound at each end" if level
            else "confidence bounds")


def slo_targets(targets_s: Mapping[str, float]) -> str:
    """SLO targets by their labels, in their units: {"tbt_p99_s": 0.05} -> "P99 TBT <= 50 ms"."""
    return ", ".join(f"{label(k)} <= {unit(k).scale * v:g} {unit(k).name}".strip()
                     for k, v in targets_s.items())


def fmt(value: float | None, scale: float = 1.0) -> str:
    """A number for a table, at most 9 characters wide (10 if negative): 4 significant digits,
    thousands separated (whole numbers from 10,000 to 9,999,999: 274,200, not 2.742e+05), then
    in exponent notation (1.185e+07), so that an 80-column table never cuts one; '-' for
    none."""
    if value is None or value != value:
        return "-"
    scaled = value * scale
    return f"{scaled:,.0f}" if 1e4 <= abs(scaled) < 9_999_999.5 else f"{scaled:,.4g}"


def pct(value: float | None) -> str:
    """A share as a percentage; '-' for none (None, or NaN: a table's missing cell)."""
    return "-" if value is None or value != value else f"{100 * value:.1f}%"
