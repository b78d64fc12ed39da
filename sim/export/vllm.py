"""A run as vLLM's serving-benchmark result file (`vllm bench serve --save-result
--save-detailed`, `vllm/benchmarks/serve.py`): the same keys, units and definitions, so that a
simulated run and a measured one can be compared key by key.

vLLM's definitions, kept here:
- `completed`: requests that succeeded; `failed`: the others. `total_input_tokens` sums the
  prompts of completed requests, `total_output_tokens` their output tokens (a failed request
  counts 0 output tokens, in `output_lens` too).
- `duration` (s): the benchmark's wall time; throughputs are totals over it.
- TTFT and E2EL over completed requests; TPOT per completed request with more than one output
  token, `(e2el - ttft) / (output_len - 1)` (it excludes the first token); ITL: every gap between
  consecutive tokens of every completed request, pooled.
- mean, median, std (population, numpy's default) and `pNN` (numpy's linear percentile; `p99.9`
  keeps its decimals) in milliseconds; per-request arrays (`ttfts`, `itls`, `latencies`,
  `start_times`) in seconds. An empty population gives 0.0, as vLLM's `np.mean(x or 0)` does.
- `max_concurrent_requests`: the most completed requests in flight at once (half-open
  intervals); `max_output_tokens_per_s`: the most output tokens of completed requests in one
  1-second bucket counted from the first completed request's start.

Where servesim differs (also listed in the file, under `servesim_notes`):
- TTFT and E2EL are client-side, as vLLM's benchmark client measures them: the engine's plus
  the API front end of the run's engine calibration (`client_ttft_s`, `client_e2e_s`); results
  from before servesim had them give the engine's own, and a note says so. `duration` is the
  run's end (`summary["run"]["end_s"]`: the horizon, else the last event)
  from the first arrival; `start_times` are arrival times (first arrival = 0).
- Rejected, failed (their client timed out) and unfinished requests (running, queued or
  transferring at the horizon, or arriving after it) are failed; `errors` holds `status:
  reason`. A failed request's `ttfts` entry is its TTFT if a token came out (as a stream cut
  short has one), else 0.0, and its `latencies` entry 0.0, as in vLLM.
- `request_goodput`: completed requests meeting the scenario's `slo` (TTFT, and TBT on each
  request's worst gap) per second; vLLM's `--goodput` takes TTFT, TPOT and E2EL targets.
  None without targets, as vLLM without `--goodput`.
- Per-request token gaps exist only for runs that recorded token times (`record_token_times:
  true`, `tokens.parquet`): without them `itls` is left out and `max_output_tokens_per_s` is
  null, and a note says so. The ITL statistics then come from the run's pooled gaps
  (`tbt_gaps.parquet`, as values with counts), which are the completed requests' gaps when no
  other request sampled two tokens; otherwise they are left out too. One ITL per token gap:
  vLLM sees one per streamed chunk, which differs where a server bundles tokens.
- Statistics are written for ttft, tpot, itl and e2el (vLLM's `--percentile-metrics
  ttft,tpot,itl,e2el`); `request_rate` is the arrivals' mean rate, `num_prompts / last
  arrival` (vLLM scales its arrival times to `num_prompts / request_rate`); there is no `date`,
  so that the same run gives the same file; `generated_texts` are empty strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.config.errors import COMMAND_LINE, InputError

if TYPE_CHECKING:
    from sim.results.run_dir import Results

SPEC_NOTE = ("speculative decoding: an ITL is the gap between two streamed chunks, a chunk "
             "holding every token one engine step gave (1 + the drafts it accepted), as "
             "vLLM's benchmark measures it; TPOT is per token")
CLIENT_NOTE = ("ttfts, latencies and their statistics are client-side: the engine's plus the "
               "API front end of the run's engine calibration (requests.parquet: client_ttft_s, "
               "client_e2e_s)")
ENGINE_SIDE_NOTE = ("ttfts, latencies and their statistics are the engine's own, from a request's "
                    "arrival: these results predate client-side latencies (simulate again for "
                    "them)")
NO_TOKENS_NOTE = ("no per-token times in this run (tokens.parquet): itls and the ITL statistics "
                  "are left out and max_output_tokens_per_s is null; set record_token_times: "
                  "true in the scenario and run it again for them")
POOLED_ITL_NOTE = ("no per-token times in this run (tokens.parquet): the ITL statistics are over "
                   "the run's pooled token gaps (tbt_gaps.parquet; no request but completed ones "
                   "sampled two tokens, so these are the completed requests' gaps); itls is "
                   "left out and max_output_tokens_per_s is null; set record_token_times: true "
                   "in the scenario and run it again for them")


GOODPUT_NOTE = ("request_goodput: completed requests meeting their SLO (ttft_s, and tbt_s on "
                "each request's worst token gap; a request class's own targets where it has "
                "them, else the scenario's slo) per second of duration; vLLM's --goodput takes "
                "ttft, tpot and e2el targets instead")


def _goodput(results: Results, req: Any, ok: np.ndarray, duration: float) -> float | None:
    """Completed requests meeting every target of their SLO (their class's, else the
    scenario's `slo`), per second; None without targets (as vLLM without --goodput)."""
    from sim.results.metrics.classes import request_targets

    scenario = results.scenario
    slo = scenario.slo
    ttft_s: float | np.ndarray | None = slo.ttft_s
    tbt_s: float | np.ndarray | None = slo.tbt_s
    if any(c.slo is not None for c in scenario.workload.classes or []):
        ttft_s, tbt_s = request_targets(req["request_class"].tolist(), scenario)
    if ttft_s is None and tbt_s is None:
        return None
    good = ok.copy()
    if ttft_s is not None:
        good &= req["ttft_s"].to_numpy(dtype=np.float64) <= ttft_s
    if tbt_s is not None:  # one token, no gap: it meets the target
        good &= ~(req["max_tbt_s"].to_numpy(dtype=np.float64) > tbt_s)
    return _per_s(int(good.sum()), duration)


# What vLLM leaves out of its file without --save-detailed.
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
                 "errors")


def vllm_result(results: Results, percentiles: Sequence[float] = (99.0,), *,
                detailed: bool = True) -> dict[str, Any]:
    """The run's figures under vLLM's result-file keys (see the module's docstring); without
    `detailed`, less the per-request arrays vLLM drops without `--save-detailed`."""
    out = _result(results, percentiles)
    return out if detailed else {k: v for k, v in out.items() if k not in DETAILED_KEYS}


def _result(results: Results, percentiles: Sequence[float]) -> dict[str, Any]:
    for p in percentiles:
        if not 0 <= p <= 100:
            raise InputError(COMMAND_LINE, "--percentiles", p, "must be between 0 and 100")
    req = results.requests.sort_values("request_id", kind="stable")
    ok = (req["status"] == "finished").to_numpy()
    arrival = req["arrival_s"].to_numpy(dtype=np.float64)
    prompt = req["num_prompt_tokens"].to_numpy(dtype=np.int64)
    generated = req["num_generated_tokens"].to_numpy(dtype=np.int64)
    output_lens = np.where(ok, generated, 0)
    client = "client_ttft_s" in req and "client_e2e_s" in req
    ttft = req["client_ttft_s" if client else "ttft_s"].to_numpy(dtype=np.float64)
    e2e = req["client_e2e_s" if client else "e2e_s"].to_numpy(dtype=np.float64)
    duration = float(results.summary["run"]["end_s"])
    total_input, total_output = int(prompt[ok].sum()), int(output_lens.sum())
    many = ok & (output_lens > 1)
    tpot = (e2e[many] - ttft[many]) / (output_lens[many] - 1)
    out: dict[str, Any] = {
        "backend": "servesim",
        "endpoint_type": "servesim",
        "label": results.scenario.name,
        "model_id": results.summary["run"]["model"],
        "tokenizer_id": None,
        "num_prompts": len(req),
        "request_rate": (len(req) / float(arrival.max())
                         if len(req) and arrival.max() > 0 else "inf"),
        "burstiness": None,
        "max_concurrency": None,
        "duration": duration,
        "completed": int(ok.sum()),
        "failed": int((~ok).sum()),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": _per_s(int(ok.sum()), duration),
        "request_goodput": _goodput(results, req, ok, duration),
        "output_throughput": _per_s(total_output, duration),
        "total_token_throughput": _per_s(total_input + total_output, duration),
        "max_concurrent_requests": peak_concurrency(arrival[ok], e2e[ok]),
        "max_output_tokens_per_s": None,
        "rtfx": 0.0,
        "input_lens": prompt.tolist(),
        "output_lens": output_lens.tolist(),
        "ttfts": np.where(np.isnan(ttft), 0.0, ttft).tolist(),
        "latencies": np.where(ok, e2e, 0.0).tolist(),
        "start_times": arrival.tolist(),
        "queue_times": [0.0] * len(req),
        "generated_texts": [""] * len(req),
        "errors": ["" if done else f"{status}: {reason}" for done, status, reason in zip(
            ok.tolist(), req["status"].tolist(), req["reason"].tolist(), strict=True)],
        "servesim_notes": [
            "servesim simulation exported as vLLM's serving-benchmark result (keys and units "
            "as vllm bench serve --save-result); differences: sim/export/vllm.py",
            f"scenario {results.scenario.name}, seed {results.scenario.seed}",
        ],
    }
    out["servesim_notes"].append(CLIENT_NOTE if client else ENGINE_SIDE_NOTE)
    if spec := results.summary.get("speculative"):
        # As `vllm bench serve` reports a speculative run (from the engine's counters).
        out.update({"spec_decode_acceptance_rate": spec["acceptance_rate"],
                    "spec_decode_acceptance_length": spec["acceptance_length"],
                    "spec_decode_num_drafts": spec["num_drafts"],
                    "spec_decode_draft_tokens": spec["draft_tokens"],
                    "spec_decode_accepted_tokens": spec["accepted_tokens"],
                    "spec_decode_per_position_acceptance_rates":
                        spec["per_position_acceptance_rates"]})
        out["servesim_notes"].append(SPEC_NOTE)
    if out["request_goodput"] is not None:
        out["servesim_notes"].append(GOODPUT_NOTE)
    out.update(metric_stats("ttft", ttft[ok], percentiles))
    out.update(metric_stats("tpot", tpot, percentiles))
    out.update(metric_stats("e2el", e2e[ok], percentiles))
    if results.tokens is None:
        gaps = results.tbt_gaps
        if gaps is None or (~ok & (generated > 1)).any():  # pooled with unfinished ones' gaps
            out["servesim_notes"].append(NO_TOKENS_NOTE)
            return out
        out.update(weighted_metric_stats("itl", gaps["gap_s"].to_numpy(dtype=np.float64),
                                         gaps["count"].to_numpy(dtype=np.int64), percentiles))
        out["servesim_notes"].append(POOLED_ITL_NOTE)
        return out
    ids = req["request_id"].to_numpy(dtype=np.int64)
    itls = request_gaps(results.tokens, ids)
    out["itls"] = [g.tolist() for g in itls]
    pooled = [g for g, done in zip(itls, ok.tolist(), strict=True) if done]
    out.update(metric_stats("itl", np.concatenate(pooled) if pooled else np.zeros(0),
                            percentiles))
    out["max_output_tokens_per_s"] = peak_tokens_per_s(results.tokens, ids[ok], arrival[ok],
                                                       e2e[ok])
    return out


def weighted_metric_stats(name: str, values_s: np.ndarray, counts: np.ndarray,
                          percentiles: Sequence[float]) -> dict[str, float]:
    """`metric_stats` of the sample in which `values_s[i]` occurs `counts[i]` times, without
    expanding it (the same order statistics and interpolation as numpy's; the mean and std
    summed as value times count, so equal up to rounding)."""
    from sim.results.metrics.summary import weighted_percentile

    keep = counts > 0
    values_s, counts = values_s[keep], counts[keep]
    total = int(counts.sum())
    if total == 0:
        return metric_stats(name, np.zeros(0), percentiles)
    order = np.argsort(values_s, kind="stable")
    values_s, cumulative = values_s[order], np.cumsum(counts[order])
    mean = float((values_s * counts[order]).sum() / total)
    std = float(np.sqrt((counts[order] * (values_s - mean) ** 2).sum() / total))
    median, *at = weighted_percentile(values_s, cumulative, (50, *percentiles))
    return _stats_ms(name, mean, float(median), std, dict(zip(percentiles, at, strict=True)))


def metric_stats(name: str, values_s: np.ndarray, percentiles: Sequence[float]
                 ) -> dict[str, float]:
    """`mean_/median_/std_/pNN_{name}_ms` as vLLM computes them (seconds in, ms out; 0.0 for no
    values)."""
    v = values_s if len(values_s) else np.zeros(1)
    return _stats_ms(name, float(np.mean(v)), float(np.median(v)), float(np.std(v)),
                     {p: np.percentile(v, p) for p in percentiles})


def _stats_ms(name: str, mean_s: float, median_s: float, std_s: float,
              at_s: dict[float, Any]) -> dict[str, float]:
    """vLLM's keys for one metric, in ms: mean, median, std, then `pNN` per percentile (`at_s`:
    percentile -> value in s; `p99.9` keeps its decimals)."""
    out = {f"mean_{name}_ms": mean_s * 1000, f"median_{name}_ms": median_s * 1000,
           f"std_{name}_ms": std_s * 1000}
    for p, value in at_s.items():
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(value) * 1000
    return out


def request_gaps(tokens: Any, request_ids: np.ndarray) -> list[np.ndarray]:
    """Each request's gaps between consecutive tokens (s), in the order of `request_ids`."""
    t = tokens.sort_values(["request_id", "token_index"], kind="stable")
    owner = t["request_id"].to_numpy(dtype=np.int64)
    times = t["time_s"].to_numpy(dtype=np.float64)
    same = owner[1:] == owner[:-1]
    gaps, gap_owner = np.diff(times)[same], owner[1:][same]
    begin = np.searchsorted(gap_owner, request_ids, side="left")
    end = np.searchsorted(gap_owner, request_ids, side="right")
    return [gaps[b:e] for b, e in zip(begin.tolist(), end.tolist(), strict=True)]


def peak_concurrency(start_s: np.ndarray, latency_s: np.ndarray) -> int:
    """The most requests in flight at once, each over [start, start + latency); an end and a
    start at the same instant: the end first."""
    if not len(start_s):
        return 0
    times = np.concatenate([start_s, start_s + latency_s])
    delta = np.concatenate([np.ones(len(start_s)), -np.ones(len(start_s))]).astype(np.int64)
    order = np.lexsort((delta, times))
    return max(0, int(np.cumsum(delta[order]).max()))


def peak_tokens_per_s(tokens: Any, request_ids: np.ndarray, start_s: np.ndarray,
                      latency_s: np.ndarray) -> float:
    """The most output tokens of `request_ids` in one 1-second bucket, buckets counted from the
    earliest start and covering up to the last end (vLLM's `max_output_tokens_per_s`)."""
    if not len(request_ids):
        return 0.0
    first = float(start_s.min())
    num_buckets = int(np.ceil(float((start_s + latency_s).max()) - first)) + 1
    times = tokens["time_s"].to_numpy(dtype=np.float64)[
        np.isin(tokens["request_id"].to_numpy(dtype=np.int64), request_ids)]
    bucket = (times - first).astype(np.int64)  # truncation, as vLLM's int()
    bucket = bucket[(bucket >= 0) & (bucket < num_buckets)]
    return float(np.bincount(bucket, minlength=num_buckets).max())


def _per_s(count: int, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None
