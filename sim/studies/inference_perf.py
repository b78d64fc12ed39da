"""An inference-perf run (`kubernetes-sigs/inference-perf`) as a measured experiment: its
results folder, as the tool writes it, on the deployment it measured (`servesim calibrate
--deployment`).

Read: `config.yaml` (the run's configuration: `data.type: shared_prefix` and its
`shared_prefix` lengths, `load.stages` of constant rates, `load.request_timeout`,
`server.ignore_eos`) and `stage_<i>_lifecycle_metrics.json` (one per stage: `successes.latency`
statistics in seconds, `successes.prompt_len`, `failures.count`). The stages run one after
another on one server, as `sim.studies.measured` runs a stage table's.

TPOT: the tool reports (last - first SSE message) / (messages - 1) per request, and vLLM's
server may stream more than one message per token (two per token in the public H100 runs).
With `ignore_eos` every request generates `output_len` tokens, so the messages per request are
1 + (E2E mean - TTFT mean) / reported TPOT mean, and every TPOT statistic is scaled by
(messages - 1) / (output_len - 1) to a time per token (as `../shared/realruns/derive.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sim.config.errors import InputError
from sim.studies.experiment import AIOHTTP_DEFAULT_TIMEOUT_S, STAGE_GAP_S, Experiment, Stage

# inference-perf's names of the statistics compared (`summarize`: mean, median, pNN).
STATISTICS = {"TPOT mean": ("time_per_output_token", "mean"),
              "TPOT P50": ("time_per_output_token", "median"),
              "TTFT mean": ("time_to_first_token", "mean"),
              "TTFT P50": ("time_to_first_token", "median"),
              "TTFT P99": ("time_to_first_token", "p99"),
              "E2E mean": ("request_latency", "mean")}
# A stage whose median TTFT passes this, or with failed requests, overloaded the server: its
# queue grew (the rule `../shared/realruns/derive.py` applies to the public runs).
OVERLOADED_TTFT_S = 10.0


def is_inference_perf(folder: Path) -> bool:
    return (folder / "config.yaml").is_file() and (folder / "stage_0_lifecycle_metrics.json"
                                                   ).is_file()


def _get(path: Path, data: Any, keys: str, kind: type | tuple[type, ...] = (int, float)) -> Any:
    """`data[k1][k2]...` for `keys` "k1.k2...", checked to be of `kind`; one line if not."""
    value = data
    for key in keys.split("."):
        if not isinstance(value, dict) or key not in value:
            raise InputError(path, keys, None, "missing (an inference-perf results folder "
                                               "holds it)")
        value = value[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise InputError(path, keys, value, "must be a number")
    if not isinstance(value, kind) or (isinstance(value, float) and not math.isfinite(value)):
        raise InputError(path, keys, value, f"must be {getattr(kind, '__name__', 'a number')}")
    return value


def read_inference_perf(folder: Path, deployment: Path) -> Experiment:
    """The experiment an inference-perf results `folder` holds, on `deployment`'s server."""
    from sim.config.input_file import read_json_file
    from sim.config.scenario import parse_scenario, scenario_source
    from sim.config.yaml_input import read_yaml

    config_path = folder / "config.yaml"
    cfg = read_yaml(config_path)
    if not isinstance(cfg, dict):
        raise InputError(config_path, "<top level>", type(cfg).__name__, "not an "
                         "inference-perf configuration")
    kind = _get(config_path, cfg, "data.type", str)
    if kind != "shared_prefix":
        raise InputError(config_path, "data.type", kind, "only shared_prefix runs are read "
                         "(their prompts are known: groups sharing a system prompt)")
    if _get(config_path, cfg, "server.ignore_eos", bool) is not True:
        raise InputError(config_path, "server.ignore_eos", False, "needs ignore_eos: true (every "
                         "request then generates output_len tokens, which servesim replays)")
    sp = "data.shared_prefix."
    system = int(_get(config_path, cfg, sp + "system_prompt_len", int))
    question = int(_get(config_path, cfg, sp + "question_len", int))
    output = int(_get(config_path, cfg, sp + "output_len", int))
    groups = int(_get(config_path, cfg, sp + "num_groups", int))
    per_group = int(_get(config_path, cfg, sp + "num_prompts_per_group", int))
    stages = _get(config_path, cfg, "load.stages", list)
    if not stages or output < 2:
        raise InputError(config_path, "load.stages" if not stages else sp + "output_len",
                         stages if not stages else output,
                         "no stage" if not stages else "TPOT needs 2 tokens or more")
    timeout = (cfg.get("load") or {}).get("request_timeout")
    timeout_s = AIOHTTP_DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    files = [folder / f"stage_{i}_lifecycle_metrics.json" for i in range(len(stages))]
    metrics = []
    for path in files:
        if not path.is_file():
            raise InputError(folder, path.name, None, f"missing: config.yaml has {len(stages)} "
                                                      "stages")
        metrics.append(read_json_file(path, None, "<file>", 1 << 26))
    rates = [float(_get(config_path, st, "rate")) for st in stages]
    durations = [float(_get(config_path, st, "duration")) for st in stages]
    # Every stage sends the same prompts (the generator's fixed set): the first stage's mean
    # length. The client's token count runs ~5% above system prompt + question (decode and
    # re-encode): spread the difference over both, as a stage table's reader does.
    prompt = float(_get(files[0], metrics[0], "successes.prompt_len.mean"))
    system_tokens = round(system * prompt / (system + question))
    base, source, base_dir = scenario_source(deployment)
    if not isinstance(base, dict):
        raise InputError(source, "<top level>", type(base).__name__,
                         "a scenario must be a mapping")
    block = int(((base.get("replica") or {}).get("kv_cache") or {}).get("block_size", 16))
    scenario: dict[str, Any] = {**base, "workload": {
        "format": "shared_prefix", "num_groups": groups, "num_prompts_per_group": per_group,
        "system_prompt_tokens": system_tokens, "question_tokens": round(prompt) - system_tokens,
        "output_tokens": output,
        "stages": [{"rate_qps": r, "duration_s": d} for r, d in zip(rates, durations,
                                                                    strict=True)],
        "stage_gap_s": STAGE_GAP_S, "hash_block_tokens": block, "timeout_s": timeout_s}}
    replica = parse_scenario(scenario, source, base_dir).replica  # checked here, once
    name = folder.resolve().name
    out = [_stage(path, m, f"{name}@{rate:g}", replica.model_name,
                  replica.parallelism.num_gpus, output)
           for path, m, rate in zip(files, metrics, rates, strict=True)]
    return Experiment(name, scenario, out, "vllm (inference-perf)", replica.gpu_name, base_dir)


def _stage(path: Path, data: Any, name: str, model: str, num_gpus: int, output: int) -> Stage:
    latency = "successes.latency."
    ttft = _get(path, data, latency + "time_to_first_token.mean")
    e2e = _get(path, data, latency + "request_latency.mean")
    tpot = _get(path, data, latency + "time_per_output_token.mean")
    # Messages per request less one, per generated token less one (see the module docstring).
    scale = (e2e - ttft) / tpot / (output - 1) if tpot > 0 else math.nan
    measured = {}
    for metric, (key, stat) in STATISTICS.items():
        value = float(_get(path, data, f"{latency}{key}.{stat}"))
        measured[metric] = 1e3 * value * (scale if key == "time_per_output_token" else 1.0)
    succeeded = int(_get(path, data, "successes.count", int))
    failed = int(_get(path, data, "failures.count", int))
    median_ttft = float(_get(path, data, latency + "time_to_first_token.median"))
    total = succeeded + failed
    return Stage(name, model, num_gpus, failed > 0 or median_ttft > OVERLOADED_TTFT_S,
                 measured, succeeded / total if total else None)
