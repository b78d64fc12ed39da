"""Measured serving runs, and servesim's error against them: what `servesim calibrate` fits to
and `validation/public/` reports.

Three layouts are read. A stage table: a CSV with one row per load stage (the layout of
`../shared/realruns/h100_vllm0151/runs.csv`, `STAGE_COLUMNS`: the deployment, the
`shared_prefix` workload as inference-perf sent it, the client-side TTFT, TPOT and E2E
statistics the stage measured and whether it overloaded); each experiment (its stages, in
order) is simulated as one run, stages 10 s apart, so a later stage starts on a warm prefix
cache as the real one did. An engine run with per-request engine timestamps (LLMServingSim's
layout), compared engine-side. And a `vllm bench serve --save-result --save-detailed` result,
one stage, replayed as sent on a deployment scenario.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sim.config.errors import InputError
from sim.studies.experiment import (  # noqa: F401  (also imported from here)
    AIOHTTP_DEFAULT_TIMEOUT_S,
    STAGE_GAP_S,
    Experiment,
    Stage,
)

METRICS = (
    ("TPOT mean", "tpot_mean_ms", "tpot_s", "mean"),
    ("TPOT P50", "tpot_p50_ms", "tpot_s", "p50"),
    ("TTFT mean", "ttft_mean_ms", "ttft_s", "mean"),
    ("TTFT P50", "ttft_p50_ms", "ttft_s", "p50"),
    ("TTFT P99", "ttft_p99_ms", "ttft_s", "p99"),
    ("E2E mean", "e2e_mean_ms", "e2e_s", "mean"),
)
CLIENT_SIDE = {"TTFT mean", "TTFT P50", "TTFT P99", "E2E mean"}  # the front end adds to these

STAGE_COLUMNS = (
    "experiment", "row_type", "stage_index", "stage_rate_req_per_s", "stage_duration_s",
    "overloaded_measured", "model_hf", "model_config", "tensor_parallel_size", "gpu", "engine",
    "engine_version", "max_num_batched_tokens", "max_num_seqs", "chunked_prefill",
    "prefix_caching", "gpu_memory_utilization", "kv_block_size_tokens", "data_generator",
    "system_prompt_len_tokens", "question_len_tokens", "prompt_len_client_mean_tokens",
    "max_tokens", "num_groups", "num_prompts_per_group",
    *(column for _, column, _, _ in METRICS))
GPU_NAMES = (("H100", "h100-sxm"), ("H200", "h200"), ("A100", "a100-80gb"), ("B200", "b200"),
             ("L40S", "l40s"), ("A10G", "a10g"), ("MI300X", "mi300x"))


def read_stages(path: Path, gpu: str | None = None) -> list[Experiment]:
    """The experiments of a stage table (`STAGE_COLUMNS`), each with its stages in order.
    `model_config` paths resolve against the file's folder, else the one above it."""
    from sim.config.input_file import check_regular

    check_regular(path, path, "<file>")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise InputError(path, "<file>", str(path), f"not a CSV table: {exc}") from None
    missing = [c for c in STAGE_COLUMNS if not rows or c not in rows[0]]
    if missing:
        raise InputError(path, missing[0], None, f"a stage table needs this column "
                         f"({len(missing)} missing: {', '.join(missing[:4])}...)")
    rows = [r for r in rows if r["row_type"] == "stage"]
    if not rows:
        raise InputError(path, "row_type", None, "no row of type 'stage'")
    groups: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault(r["experiment"], []).append(r)
    return [_experiment(path, name, sorted(group, key=lambda r: _int(path, r, "stage_index")),
                        gpu) for name, group in groups.items()]


# vLLM's result keys of the compared statistics (ms), per metric.
VLLM_KEYS = {"TPOT mean": "mean_tpot_ms", "TPOT P50": "median_tpot_ms",
             "TTFT mean": "mean_ttft_ms", "TTFT P50": "median_ttft_ms",
             "TTFT P99": "p99_ttft_ms", "E2E mean": "mean_e2el_ms"}


def read_measured(path: Path, gpu: str | None = None, deployment: Path | None = None
                  ) -> list[Experiment]:
    """The experiments of a measured file: a stage table (`.csv`, `read_stages`), an engine
    run's folder (`read_engine_run`), an inference-perf results folder
    (`sim.studies.inference_perf`) or a `vllm bench serve` result (`.json`,
    `read_vllm_bench`); the last two with the `deployment` they ran on."""
    if path.is_dir():
        from sim.studies.inference_perf import is_inference_perf, read_inference_perf

        if is_inference_perf(path):
            if deployment is None:
                raise InputError(path, "<folder>", str(path), "an inference-perf run needs "
                                 "--deployment: a scenario file of the server it measured")
            return [read_inference_perf(path, deployment)]
        return [read_engine_run(path, gpu)]
    if path.suffix == ".json":
        if deployment is None:
            raise InputError(path, "<file>", str(path), "a vllm bench serve result needs "
                             "--deployment: a scenario file of the server it measured")
        return [read_vllm_bench(path, deployment)]
    return read_stages(path, gpu)


# GPUs by the folder an engine run sits in (LLMServingSim's `bench/examples/<GPU>/...`).
RUN_GPUS = {"RTX4090": "rtx4090", "RTXPRO6000": "rtxpro6000", "H100": "h100-sxm",
            "A100": "a100-80gb", "H200": "h200", "B200": "b200", "L40S": "l40s"}


def read_engine_run(run: Path, gpu: str | None = None) -> Experiment:
    """A run of vLLM's engine with per-request engine timestamps (LLMServingSim's `bench`
    layout: `meta.json` with the engine's arguments, `requests.jsonl` with each request's
    lengths and `queued_ts`, `first_token_ts`, `last_token_ts`): its requests replayed as the
    engine core received them (`format: jsonl`, arrivals at `queued_ts`) on the deployment its
    arguments give, compared engine-side (no API server: the prompts came as token ids). A
    data-parallel run is several engine cores in one replica (`parallelism.data`), its
    experts spread over them where the run enabled expert parallelism, else sliced."""
    from sim.config.input_file import read_json_file
    from sim.hardware.models import COMMITTED

    meta_path, requests = run / "meta.json", run / "requests.jsonl"
    meta = read_json_file(meta_path, None, "<file>", 1 << 24)
    args = meta.get("engine_kwargs") if isinstance(meta, dict) else None
    if not isinstance(args, dict):
        raise InputError(meta_path, "engine_kwargs", None, "an engine run's meta.json names "
                         "the engine's arguments")
    tensor, data = int(args.get("tensor_parallel_size") or 1), int(
        args.get("data_parallel_size") or 1)
    # Without expert parallelism, each expert sliced over every GPU (`Parallelism`).
    expert = data * tensor if args.get("enable_expert_parallel") else 1
    hf = str(args.get("model", ""))
    model = next((name for name, repo in COMMITTED.items()
                  if hf == repo or hf.startswith(repo + "-")), None)
    if model is None:
        raise InputError(meta_path, "engine_kwargs.model", hf, "no registered model by that "
                         "Hugging Face name")
    folder = next((part for part in reversed(run.parts) if part in RUN_GPUS), None)
    gpu_name = gpu or (RUN_GPUS[folder] if folder else None)
    if gpu_name is None:
        raise InputError(run, "<folder>", str(run), "no GPU in its path (one of "
                         f"{', '.join(RUN_GPUS)}): give --gpu")
    kv = meta.get("kv_cache") if isinstance(meta.get("kv_cache"), dict) else {}
    replica: dict[str, Any] = {
        "model": model, "gpu": gpu_name,
        "parallelism": {"tensor": tensor, "data": data, "expert": expert},
        "scheduler": {"name": "vllm_v1", "max_num_seqs": int(args.get("max_num_seqs") or 256),
                      "max_num_batched_tokens": int(args.get("max_num_batched_tokens") or 2048)},
        "prefix_caching": bool(kv.get("enable_prefix_caching", True)),
    }
    if data > 1:
        # Its ranks' padding is its release's (servesim's vLLM rules are 0.15.1's or 0.33.0's;
        # from 0.19 on, only steps that fit a CUDA graph are padded).
        release = tuple(int(x) for x in re.findall(r"\d+", str(meta.get("vllm_version")))[:2])
        if len(release) == 2:
            replica["scheduler"]["data_parallel_padding"] = (
                "every_step" if release < (0, 19) else "graph_steps")
    if args.get("max_model_len"):
        replica["max_model_len"] = int(args["max_model_len"])
    if kv.get("num_gpu_blocks"):  # what the engine logged it had, where it did
        replica["kv_cache"] = {"num_blocks": int(kv["num_gpu_blocks"]),
                               "block_size": int(kv.get("block_size") or 16)}
    scenario: dict[str, Any] = {
        "seed": 0,
        "workload": {"format": "jsonl", "path": str(_in_queued_order(requests)),
                     "columns": {"arrival": "queued_ts", "prompt_tokens": "input_toks",
                                 "output_tokens": "output_toks"}},
        "replica": replica,
    }
    measured = _engine_run_stats(requests)
    name = "/".join(run.parts[-3:-1]) if len(run.parts) >= 3 else run.name
    stage = Stage(name, hf, replica["parallelism"]["tensor"], None, measured)
    return Experiment(name, scenario, [stage], f"vllm {meta.get('vllm_version', '?')} (engine)",
                      gpu_name, engine_side=True)


def _in_queued_order(path: Path) -> Path:
    """`path`, or where its lines are not in the order their requests were queued (a
    data-parallel run's engines log them as each finishes its own), a copy of it in that
    order (in the temporary directory, named by its content)."""
    import hashlib
    import json
    import tempfile

    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        queued = [json.loads(line)["queued_ts"] for line in lines]
    except (OSError, ValueError, KeyError, TypeError):
        return path.resolve()  # (the workload's reader says what is wrong with it)
    if all(a <= b for a, b in zip(queued, queued[1:], strict=False)):
        return path.resolve()
    text = "\n".join(line for _, line in sorted(zip(queued, lines, strict=True),
                                                key=lambda pair: pair[0])) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    copy = Path(tempfile.gettempdir()) / "servesim-measured" / f"{digest}.jsonl"
    if not copy.is_file():
        from sim.results.outdir import replace_text

        copy.parent.mkdir(parents=True, exist_ok=True)
        replace_text(copy, text)  # (whole or not at all: another process may read it)
    return copy


def _engine_run_stats(path: Path) -> dict[str, float]:
    """The compared statistics (ms) of an engine run's requests, as LLMServingSim defines its
    latencies (TTFT = first token - queued, TPOT = (last - first) / (outputs - 1), E2E = last
    token - queued) and servesim's summary its statistics (`distribution`)."""
    import json

    from sim.results.metrics.summary import distribution

    ttft, tpot, e2e = [], [], []
    number = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                number += 1
                if not line.strip():
                    continue
                r = json.loads(line)
                queued, first, last = r["queued_ts"], r["first_token_ts"], r["last_token_ts"]
                ttft.append(first - queued)
                e2e.append(last - queued)
                if r["output_toks"] > 1:
                    tpot.append((last - first) / (r["output_toks"] - 1))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(path, "<file>", str(path), f"not an engine run's requests (line "
                         f"{number}: {exc})") from None
    if not ttft:
        raise InputError(path, "<file>", str(path), "no request")
    stats = {"ttft_s": distribution(ttft), "tpot_s": distribution(tpot),
             "e2e_s": distribution(e2e)}
    # None (no request with two tokens: no TPOT) as NaN, not compared (`errors_pct`).
    return {name: math.nan if (v := stats[key][stat]) is None else 1e3 * float(v)
            for name, _, key, stat in METRICS}


def read_vllm_bench(path: Path, deployment: Path) -> Experiment:
    """One `vllm bench serve --save-result --save-detailed` run as an experiment of one stage:
    its requests as sent (`format: vllm_bench`, failed ones left out) on the `deployment`
    scenario's server (its workload replaced). Whether the server was overloaded is not in the
    file: not compared."""
    from sim.config.input_file import read_json_file
    from sim.config.scenario import parse_scenario, scenario_source

    data = read_json_file(path, None, "<file>", 2 << 30)
    if not isinstance(data, dict):
        raise InputError(path, "<top level>", type(data).__name__, "not a vllm bench result")
    measured = {}
    for metric, key in VLLM_KEYS.items():
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InputError(path, key, value, "a number of milliseconds")
        measured[metric] = math.nan if value is None else float(value)
    base, source, base_dir = scenario_source(deployment)
    if not isinstance(base, dict):
        raise InputError(source, "<top level>", type(base).__name__,
                         "a scenario must be a mapping")
    scenario_data = {**base, "workload": {"format": "vllm_bench", "path": str(path.resolve()),
                                          "failed": "skip"}}
    replica = parse_scenario(scenario_data, source, base_dir).replica  # checked here, once
    name = path.stem
    stage = Stage(name, replica.model_name, replica.parallelism.num_gpus, None, measured)
    return Experiment(name, scenario_data, [stage], f"{data.get('backend', 'vllm')} (vllm "
                      "bench serve)", replica.gpu_name, base_dir)


def _int(path: Path, row: dict[str, str], column: str) -> int:
    try:
        return int(row[column])
    except ValueError:
        raise InputError(path, column, row[column], f"{row['experiment']}: not a whole "
                         "number") from None


def _float(path: Path, row: dict[str, str], column: str) -> float:
    try:
        value = float(row[column])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InputError(path, column, row[column], f"{row['experiment']}: not a number")
    return value


def _measured(path: Path, row: dict[str, str], column: str) -> float:
    """A measured statistic: a number, or NaN where the table leaves it blank."""
    return math.nan if not row[column].strip() else _float(path, row, column)


def _experiment(path: Path, name: str, rows: list[dict[str, str]], gpu: str | None
                ) -> Experiment:
    row = rows[0]
    if row["data_generator"] != "shared_prefix":
        raise InputError(path, "data_generator", row["data_generator"],
                         f"{name}: only shared_prefix stages are simulated")
    gpu_name = gpu or next((ours for key, ours in GPU_NAMES if key in row["gpu"].upper()), None)
    if gpu_name is None:
        raise InputError(path, "gpu", row["gpu"], f"{name}: no servesim GPU by that name; "
                         "give --gpu")
    config = Path(row["model_config"])
    model = next((p for p in (path.parent / config, path.parent.parent / config)
                  if p.is_file()), None)
    if model is None:
        raise InputError(path, "model_config", row["model_config"],
                         f"{name}: not found beside the table or in the folder above it")
    system = _int(path, row, "system_prompt_len_tokens")
    question = _int(path, row, "question_len_tokens")
    prompt = round(_float(path, row, "prompt_len_client_mean_tokens"))
    # The client's count runs ~5% above system prompt + question (its tokenizer's decode and
    # re-encode): spread the difference over both.
    system_tokens = round(system * prompt / (system + question))
    tp = _int(path, row, "tensor_parallel_size")
    timeout_s = _timeout_s(path, row)
    scenario = {
        "seed": 0,
        "workload": {
            "format": "shared_prefix", "num_groups": _int(path, row, "num_groups"),
            "num_prompts_per_group": _int(path, row, "num_prompts_per_group"),
            "system_prompt_tokens": system_tokens, "question_tokens": prompt - system_tokens,
            "output_tokens": _int(path, row, "max_tokens"),
            "stages": [{"rate_qps": _float(path, r, "stage_rate_req_per_s"),
                        "duration_s": _float(path, r, "stage_duration_s")} for r in rows],
            "stage_gap_s": STAGE_GAP_S,
            "hash_block_tokens": _int(path, row, "kv_block_size_tokens"),
            **({"timeout_s": timeout_s} if timeout_s is not None else {})},
        "replica": {
            "model": str(model), "gpu": gpu_name, "parallelism": {"tensor": tp},
            "scheduler": {"name": "vllm_v1", "engine_version": row["engine_version"],
                          "max_num_batched_tokens": _int(path, row, "max_num_batched_tokens"),
                          "max_num_seqs": _int(path, row, "max_num_seqs"),
                          "enable_chunked_prefill": row["chunked_prefill"] == "true"},
            "kv_cache": {"block_size": _int(path, row, "kv_block_size_tokens"),
                         "gpu_memory_utilization": _float(path, row, "gpu_memory_utilization")},
            "prefix_caching": row["prefix_caching"] == "true",
            **({"kv_offload": offload} if (offload := _offload(path, row)) else {})},
    }
    stages = [Stage(f"{name}@{_float(path, r, 'stage_rate_req_per_s'):g}", r["model_hf"], tp,
                    r["overloaded_measured"] == "true",
                    {metric: _measured(path, r, column) for metric, column, _, _ in METRICS},
                    _succeeded(path, r))
              for r in rows]
    return Experiment(name, scenario, stages, f"{row['engine']} {row['engine_version']}",
                      gpu_name)


def _offload(path: Path, row: dict[str, str]) -> dict[str, float] | None:
    """The CPU tier the run had (`kv_cpu_offload_connector` OffloadingConnector, its size in
    GiB: vLLM's `--kv-offloading-size`), as `replica.kv_offload`; None where the table has no
    such column, or none was on."""
    connector = (row.get("kv_cpu_offload_connector") or "").strip()
    if not connector or connector.lower() in ("none", "off", "false"):
        return None
    if connector != "OffloadingConnector":
        raise InputError(path, "kv_cpu_offload_connector", connector,
                         "only vLLM's native OffloadingConnector is modelled")
    return {"size_gib": _float(path, row, "kv_cpu_offload_size_GiB")}


def _timeout_s(path: Path, row: dict[str, str]) -> float | None:
    """The client's timeout (`request_timeout`: seconds, or text saying it was unset, when
    aiohttp's default applied); None where the table has no such column or leaves it blank."""
    text = (row.get("request_timeout") or "").strip()
    if not text:
        return None
    if text.lower().startswith("unset"):
        return AIOHTTP_DEFAULT_TIMEOUT_S
    return _float(path, row, "request_timeout")


def _succeeded(path: Path, row: dict[str, str]) -> float | None:
    """The share of a stage's requests that succeeded, where the table counts them."""
    if not (row.get("requests_sent") or "").strip() or not (
            row.get("requests_succeeded") or "").strip():
        return None
    sent = _float(path, row, "requests_sent")
    return _float(path, row, "requests_succeeded") / sent if sent > 0 else None


def simulate(args: tuple[Experiment, dict[str, Any]]) -> list[dict[str, Any]]:
    """One experiment's stages as simulated with `replica` fields set (ms; TTFT and E2E
    client-side, engine-side for an experiment measured in the engine) and overload
    verdicts."""
    from sim import run_scenario
    from sim.config.scenario import merge_mappings, parse_scenario

    exp, replica = args
    data = merge_mappings(exp.scenario, {"replica": replica})
    summary = run_scenario(parse_scenario(data, exp.name, exp.base_dir)).summary
    out = []
    for stage in summary.get("stages", [summary]):
        requests = stage["requests"]
        got: dict[str, Any] = {"overloaded": stage["overload"]["verdict"] != "stable",
                               "succeeded": requests["finished"] / requests["total"]
                               if requests["total"] else None}
        for name, _, key, stat in METRICS:
            key = f"client_{key}" if name in CLIENT_SIDE and not exp.engine_side else key
            value = stage[key][stat]
            got[name] = None if value is None else value * 1e3
        out.append(got)
    return out


def errors_pct(stages: Sequence[Stage], sims: Sequence[dict[str, Any]], added_ms: np.ndarray
               ) -> list[dict[str, float | None]]:
    """(simulated + front end - measured) / measured in %, per stable stage and metric; None
    for overloaded stages (their survivors' latencies are no steady state) and missing
    values."""
    out: list[dict[str, float | None]] = []
    for stage, sim, added in zip(stages, sims, added_ms, strict=True):
        row: dict[str, float | None] = {}
        for name, *_ in METRICS:
            got, measured = sim[name], stage.measured_ms[name]
            if stage.overloaded or got is None or not (math.isfinite(measured) and measured):
                row[name] = None
                continue
            got += added if name in CLIENT_SIDE else 0.0
            row[name] = 100.0 * (got - measured) / measured
        out.append(row)
    return out


def median_abs(errors: Sequence[dict[str, float | None]], name: str) -> float | None:
    values = [abs(e) for row in errors if (e := row[name]) is not None]
    return float(np.median(values)) if values else None
