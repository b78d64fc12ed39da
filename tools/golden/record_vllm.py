"""Record golden schedules from the installed vLLM's own scheduler, on a CPU, on a virtual clock.

Run it in a separate environment that has vLLM (never servesim's: CI must not need it):

    python -m venv ~/venv-vllm && ~/venv-vllm/bin/pip install vllm==0.33.0
    ~/venv-vllm/bin/python tools/golden/record_vllm.py --out tests/golden/vllm [NAME ...]

The scheduler (`Scheduler`, or `AsyncScheduler` with async scheduling) is built as vLLM's own
tests build it (tests/v1/core/utils.py): a one-layer Llama config written to a temporary
folder, `skip_tokenizer_init`, a `KVCacheConfig` of the workload's block count. The engine
loop is EngineCore's, on a virtual clock: `step` (schedule, run, `update_from_output`) or,
with async scheduling, `step_with_batch_queue` (two batches in flight: the next is scheduled
as soon as one is sent, and the engine blocks on the oldest). A batch of n scheduled tokens
runs for base_s + per_token_s * n on one GPU, after the batch before it; an empty batch takes
no time. Requests are added at their arrival times, between engine steps, with
`ignore_eos` and `max_tokens` = their output length; the fake model samples one token for
each request its step caught up (`is_prefill_chunk` false).

With `settings.speculative` the drafter proposes k draft tokens for every request of a step
(none where vLLM tells it to skip: `skip_drafts`); synchronous, they reach the scheduler as
`EngineCore.post_step` hands them over (`update_draft_token_ids`). A step that verified s
drafts samples a + 1 tokens, a drawn by servesim's `sim.core.speculative.Acceptance` from the
workload's rates and seed (the data decides acceptance; the draw is the same on both sides),
0 for the padding a request admitted from the queue is given.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.golden.fixture import write_fixture  # noqa: E402
from tools.golden.workloads import (  # noqa: E402
    WORKLOADS,
    Workload,
    output_token_id,
    prompt_token_ids,
)

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


def build_scheduler(workload: Workload, model_dir: str) -> Any:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    s = workload["settings"]
    block_size = workload["block_size"]
    scheduler_config = SchedulerConfig(
        max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
        max_model_len=workload["max_model_len"],
        long_prefill_token_threshold=s["long_prefill_token_threshold"],
        enable_chunked_prefill=s["enable_chunked_prefill"],
        async_scheduling=s["async_scheduling"], is_encoder_decoder=False,
        policy=s.get("scheduling_policy", "fcfs"))
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                               seed=0, max_model_len=workload["max_model_len"])
    cache_config = CacheConfig(block_size=block_size,
                               enable_prefix_caching=s["enable_prefix_caching"])
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig("cpu"),
                             speculative_config=speculative_config(workload, model_config))
    num_blocks = workload["num_gpu_blocks"]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cache_config.num_gpu_blocks = num_blocks
    if s["enable_prefix_caching"]:
        init_none_hash(get_hash_fn_by_name(cache_config.prefix_caching_hash_algo))
    cls = AsyncScheduler if s["async_scheduling"] else Scheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=False,
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=block_size)


def speculative_config(workload: Workload, model_config: Any) -> Any:
    """vLLM's `SpeculativeConfig` for the workload's `settings.speculative` (None: off). An
    EAGLE drafter gets a config.json of its own (one layer, the fake model's sizes); the
    scheduler reads only its method and `num_speculative_tokens`."""
    spec = workload["settings"].get("speculative")
    if not spec:
        return None
    from vllm.config import ParallelConfig, SpeculativeConfig

    method, k = spec["method"], spec["num_speculative_tokens"]
    common = {"num_speculative_tokens": k, "target_model_config": model_config,
              "target_parallel_config": ParallelConfig()}
    if method == "ngram":
        return SpeculativeConfig(method="ngram", prompt_lookup_max=4, prompt_lookup_min=2,
                                 **common)
    draft_dir = tempfile.mkdtemp()
    arch = {"eagle": "EagleLlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3",
            "draft_model": "LlamaForCausalLM"}[method]
    Path(draft_dir, "config.json").write_text(json.dumps({**LLAMA_CONFIG,
                                                          "architectures": [arch]}))
    return SpeculativeConfig(method=method, model=draft_dir, **common)


def make_request(workload: Workload, request_id: int, hasher: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    entry = workload["requests"][request_id]
    arrival_s, num_output = entry[0], entry[2]
    params = SamplingParams(max_tokens=num_output, ignore_eos=True)
    extra = {}
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:  # 0.15.1 asks for it
        extra["eos_token_id"] = LLAMA_CONFIG["eos_token_id"]
    return Request(str(request_id), prompt_token_ids=prompt_token_ids(workload, request_id),
                   sampling_params=params, pooling_params=None, arrival_time=arrival_s,
                   block_hasher=hasher, priority=entry[5] if len(entry) > 5 else 0, **extra)


def _samples(request: Any, placeholders_before: int, async_on: bool) -> bool:
    """Whether the step just scheduled catches `request` up, so that it samples a token: the
    flag `_update_after_schedule` sets (0.33.0: `is_prefill_chunk`); in 0.15.1, which has no
    flag, a placeholder added (async) or every known token computed."""
    flag = getattr(request, "is_prefill_chunk", None)
    if flag is not None:
        return not flag
    if async_on:
        return bool(request.num_output_placeholders > placeholders_before)
    return bool(request.num_computed_tokens >= request.num_tokens)


def record(workload: Workload) -> dict[str, Any]:
    """Drive vLLM's scheduler through `workload`; the fixture's body (see `fixture.py`)."""
    from vllm.v1.outputs import ModelRunnerOutput

    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(LLAMA_CONFIG))
        sched = build_scheduler(workload, model_dir)
    hasher = None
    if workload["settings"]["enable_prefix_caching"]:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        hasher = get_request_block_hasher(
            workload["block_size"],
            get_hash_fn_by_name(sched.vllm_config.cache_config.prefix_caching_hash_algo))

    # Preemptions in the order the scheduler makes them (its output keeps a set).
    preempted_order: list[str] = []
    original_preempt = sched._preempt_request

    def preempt(request: Any, *args: Any, **kwargs: Any) -> None:
        preempted_order.append(request.request_id)
        original_preempt(request, *args, **kwargs)

    sched._preempt_request = preempt

    spec = workload["settings"].get("speculative")
    acceptance = None
    if spec:
        from vllm.v1.outputs import DraftTokenIds

        from sim.core.speculative import Acceptance

        rate = spec["acceptance_rate"]
        acceptance = Acceptance(rate if isinstance(rate, list)
                                else [rate] * spec["num_speculative_tokens"], workload["seed"])
    admitted_now: dict[int, set[str]] = {}  # per step sent: requests it took from the queue
    # Requests whose drafts came after a step that sampled nothing for them (0.15.1's padded
    # drafter batch proposes for a prompt's unfinished chunk too): none can be accepted.
    blind_drafts: set[str] = set()

    step = workload["step_time"]
    base_s, per_token_s = step["base_s"], step["per_token_s"]
    arrivals = workload["requests"]
    handles: dict[int, Any] = {}
    times: dict[int, dict[str, Any]] = {}
    steps: list[list[Any]] = []
    async_on = workload["settings"]["async_scheduling"]
    depth = 2 if async_on else 1
    queue: deque[tuple[Any, list[str], float, float, list[Any]]] = deque()  # oldest at right
    now_s = 0.0
    gpu_free_s = 0.0
    next_arrival = 0

    def add_arrived() -> None:
        nonlocal next_arrival
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now_s:
            rid = next_arrival
            req = make_request(workload, rid, hasher)
            handles[rid] = req
            times[rid] = {"first_scheduled_s": None, "first_token_s": None, "finish_s": None}
            sched.add_request(req)
            next_arrival += 1

    def send() -> None:
        nonlocal gpu_free_s
        del preempted_order[:]
        placeholders = {rid: getattr(r, "num_output_placeholders", 0)
                        for rid, r in sched.requests.items()}
        queued = {rid for rid, r in sched.requests.items() if r.status.name != "RUNNING"}
        out = sched.schedule()
        admitted_now[id(out)] = queued & set(out.num_scheduled_tokens)
        scheduled = list(out.num_scheduled_tokens.items())
        samples = [rid for rid, _ in scheduled
                   if _samples(sched.requests[rid], placeholders.get(rid, 0), async_on)]
        total = out.total_num_scheduled_tokens
        if total:
            start_s = max(now_s, gpu_free_s)
            end_s = start_s + (base_s + per_token_s * total)
            gpu_free_s = end_s
        else:
            start_s = end_s = now_s
        entry = [start_s, end_s, [[int(rid), n] for rid, n in scheduled],
                 [int(rid) for rid in preempted_order]]
        steps.append(entry)
        for rid, _ in scheduled:
            t = times[int(rid)]
            if t["first_scheduled_s"] is None:
                t["first_scheduled_s"] = start_s
        queue.appendleft((out, samples, start_s, end_s, entry))

    def receive() -> None:
        nonlocal now_s
        out, samples, _, end_s, _ = queue.pop()
        now_s = max(now_s, end_s)
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[output_token_id(int(rid), handles[int(rid)].num_output_tokens
                                    + handles[int(rid)].num_output_placeholders)]
                   if rid in samples else [] for rid in req_ids]
        padded = admitted_now.pop(id(out))
        if acceptance is not None:
            for i, rid in enumerate(req_ids):
                num_spec = len(out.scheduled_spec_decode_tokens.get(rid, ()))
                if not sampled[i] or not num_spec or rid in padded or rid in blind_drafts:
                    continue
                n = handles[int(rid)].num_output_tokens
                num_accepted = acceptance.accepted(int(rid), n, num_spec)
                sampled[i] = [output_token_id(int(rid), n + j) for j in range(num_accepted + 1)]
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled)
        sched.update_from_output(out, output)
        if acceptance is not None and not async_on and out.total_num_scheduled_tokens:
            # `EngineCore.post_step`: the drafter's proposals for the requests of the step.
            # (n-gram lookup proposes nothing for a request that sampled nothing.)
            k = 0 if getattr(out, "skip_drafts", False) else spec["num_speculative_tokens"]
            blind = [] if spec["method"] == "ngram" else [r for r in req_ids if r not in samples]
            blind_drafts.difference_update(req_ids)
            blind_drafts.update(blind)
            sched.update_draft_token_ids(DraftTokenIds(
                req_ids, [[output_token_id(int(rid), 10_000 + j)
                           for j in range(k if rid in samples or rid in blind else 0)]
                          for rid in req_ids]))
        for rid in samples:
            req = handles[int(rid)]
            t = times[int(rid)]
            if t["first_token_s"] is None and req.num_output_tokens > 0:
                t["first_token_s"] = now_s
            if t["finish_s"] is None and req.is_finished():
                t["finish_s"] = now_s

    while True:
        add_arrived()
        if sched.has_requests() and len(queue) < depth:
            send()
            if len(queue) < depth:
                continue  # the batch queue is not full: schedule another at once
        if not queue:
            if next_arrival == len(arrivals):
                break
            now_s = max(now_s, arrivals[next_arrival][0])
            continue
        receive()
        # Nothing in flight and nothing scheduled (an empty batch: only finished requests
        # were left to report, or none can run): wait for work.
        if not queue and steps and not steps[-1][2] and not steps[-1][3]:
            steps.pop()
            if next_arrival == len(arrivals):
                if any(sched.get_request_counts()):
                    raise RuntimeError(f"{workload['name']}: requests left, none can run")
                break
            now_s = max(now_s, arrivals[next_arrival][0])
    unfinished = [rid for rid, t in times.items() if t["finish_s"] is None]
    assert not unfinished and len(times) == len(arrivals), unfinished[:5]
    return {"steps": steps,
            "requests": [[times[r]["first_scheduled_s"], times[r]["first_token_s"],
                          times[r]["finish_s"], handles[r].num_preemptions]
                         for r in range(len(arrivals))]}


def main() -> None:
    import vllm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("names", nargs="*", help="workloads (default: all)")
    args = parser.parse_args()
    names = args.names or list(WORKLOADS)
    for name in names:
        workload = WORKLOADS[name]
        body = record(workload)
        path = write_fixture(args.out, workload, body, engine="vllm",
                             engine_version=vllm.__version__,
                             command="python tools/golden/record_vllm.py --out "
                                     f"{args.out} {name}")
        print(f"{name}: {len(body['steps'])} steps -> {path}")


if __name__ == "__main__":
    main()
