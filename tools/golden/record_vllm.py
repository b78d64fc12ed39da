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
import mmap
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
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
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
    attention = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                  dtype=torch.float32)
    offload = s.get("kv_offload")
    kv_transfer_config = None
    # (0.33.0's tensors name their layers and strides; 0.15.1's say which layers share them.)
    v15_tensors = "shared_by" in KVCacheTensor.__dataclass_fields__
    if offload:
        from vllm.config import KVTransferConfig

        # The native CPU offloading, as `--kv-offloading-size` sets it: the connector's blocks
        # are the bytes given over a block's page (one layer, one GPU: `CPUOffloadingSpec`;
        # 0.33.0 rounds a block's bytes up to a memory page).
        page = attention.page_size_bytes
        if not v15_tensors:
            page = -(-page // mmap.PAGESIZE) * mmap.PAGESIZE
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": offload["num_cpu_blocks"] * page,
                **{key: offload[key] for key in ("eviction_policy", "store_threshold")
                   if key in offload}})
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig("cpu"),
                             speculative_config=speculative_config(workload, model_config),
                             kv_transfer_config=kv_transfer_config)
    num_blocks = workload["num_gpu_blocks"]
    size = attention.page_size_bytes * num_blocks
    tensor = (KVCacheTensor(size=size, shared_by=["layer"]) if v15_tensors else
              KVCacheTensor(size=size, layers=["layer"], layer_stride=size,
                            block_stride=attention.page_size_bytes))
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        # (0.15.1's `CPUOffloadingSpec` counts the tensors: one, the one layer's.)
        kv_cache_tensors=[tensor] if offload else [],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], attention)])
    cache_config.num_gpu_blocks = num_blocks
    spec_config = vllm_config.speculative_config
    if spec_config is not None and hasattr(spec_config, "use_eagle_block_drop"):
        # (0.33.0's `kv_cache_planning` marks the drafter's group, its one group here, as
        # vLLM's own KV config builder would; its offloading connector reads the mark.)
        kv_cache_config.kv_cache_groups[0].is_eagle_group = spec_config.use_eagle_block_drop()
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
    if spec.get("num_speculative_tokens_per_batch_size") is not None:  # (0.33.0's dynamic k)
        common["num_speculative_tokens_per_batch_size"] = [
            tuple(entry) for entry in spec["num_speculative_tokens_per_batch_size"]]
    if method == "ngram":
        return SpeculativeConfig(method="ngram", prompt_lookup_max=4, prompt_lookup_min=2,
                                 **common)
    draft_dir = tempfile.mkdtemp()
    arch = {"eagle": "EagleLlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3",
            "draft_model": "LlamaForCausalLM"}[method]
    Path(draft_dir, "config.json").write_text(json.dumps({**LLAMA_CONFIG,
                                                          "architectures": [arch]}))
    return SpeculativeConfig(method=method, model=draft_dir, **common)


class Copies:
    """The copy engine under vLLM's own offloading worker (`OffloadingConnectorWorker`, its
    bookkeeping unchanged), on the virtual clock: one queue per direction, in submission
    order; a copy of n blocks takes n times `s_per_block`; a store starts once the GPU has
    computed the step that planned it (`after_s`). `now_s` is the engine's clock when the
    worker acts (its launch of a step); `wait` blocks it until the copies named end."""

    def __init__(self, s_per_block: float, loads_after_compute: bool = False) -> None:
        self.s_per_block = s_per_block
        self.loads_after_compute = loads_after_compute
        self.now_s = 0.0
        self.after_s = -float("inf")
        self.free_s = {"load": -float("inf"), "store": -float("inf")}
        self.jobs: dict[int, float] = {}  # job id -> when it ends
        self.v033 = False  # (which `get_finished` the worker calls: set by `worker_connector`)

    def _submit(self, job_id: int, kind: str, num_blocks: int) -> bool:
        after_s = self.after_s if kind == "store" or self.loads_after_compute else self.now_s
        start_s = max(self.now_s, self.free_s[kind], after_s)
        done_s = start_s + num_blocks * self.s_per_block
        self.free_s[kind] = done_s
        self.jobs[job_id] = done_s
        return True

    def transfer_async(self, job_id: int, spec: Any) -> bool:  # (0.15.1)
        src, dst = spec
        store = type(src).__name__.startswith("GPU")
        return self._submit(job_id, "store" if store else "load",
                            len((src if store else dst).block_ids))

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:  # (0.33.0)
        return self._submit(job_id, "store", len(src_spec.block_ids))

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                    expedited: bool = False) -> bool:  # (0.33.0)
        return self._submit(job_id, "load", len(dst_spec.block_ids))

    def get_finished(self) -> list[Any]:
        done = [j for j, t in self.jobs.items() if t <= self.now_s]
        for j in done:
            del self.jobs[j]
        if self.v033:
            from vllm.v1.kv_offload.base import TransferResult

            return [TransferResult(j, True) for j in done]
        return [(j, True) for j in done]

    def wait(self, job_ids: set[int]) -> None:
        ends = [self.jobs[j] for j in job_ids if j in self.jobs]
        if ends:
            self.now_s = max(self.now_s, max(ends))

    def next_done_s(self) -> float:
        return min(self.jobs.values(), default=float("inf"))


class IdOrderedSet(set):  # type: ignore[type-arg]
    """A set of request ids (strings of integers) that iterates in id order."""

    def __iter__(self) -> Any:
        return iter(sorted(set.__iter__(self), key=int))


def worker_connector(sched: Any, s_per_block: float) -> tuple[Any, Copies]:
    """vLLM's offloading connector in its worker role, its copy engine `Copies` (the CUDA
    copies are the only part replaced: `register_kv_caches` would need a GPU)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    conn = OffloadingConnector(sched.vllm_config, KVConnectorRole.WORKER,
                               sched.kv_cache_config)
    v033 = hasattr(conn, "build_connector_worker_meta")
    # (0.33.0 submits a step's loads once its forward is launched, on a copy stream that
    # waits for the compute stream: they start when the step's GPU time ends.)
    copies = Copies(s_per_block, loads_after_compute=v033)
    copies.v033 = v033
    conn.connector_worker.worker = copies
    return conn, copies


def worker_pre_forward(conn: Any, out: Any) -> None:
    """0.33.0's connector calls before a step's forward (`ActiveKVConnector.pre_forward`):
    `handle_preemptions` (submits the stores the step before deferred, and those it must
    flush, and waits for the latter: may block), then the step's metadata bound."""
    conn.handle_preemptions(out.kv_connector_metadata)
    conn.bind_connector_metadata(out.kv_connector_metadata)


def worker_post_forward(conn: Any, out: Any) -> Any:
    """0.33.0's connector calls after the forward's launch (`_get_kv_connector_output`):
    the step's loads started, its stores deferred to the next step (`wait_for_save`, empty
    steps too), the poll, the completed jobs for the scheduler."""
    from vllm.v1.outputs import KVConnectorOutput

    conn.start_load_kv(None)
    conn.wait_for_save()
    results = conn.get_transfer_results(out.finished_req_ids)
    meta = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    return KVConnectorOutput(
        finished_sending=sorted(results.finished_sending, key=int) or None,
        finished_recving=sorted(results.finished_recving, key=int) or None,
        kv_connector_worker_meta=meta)


def worker_step(conn: Any, out: Any) -> Any:
    """One `execute_model`'s connector calls, in 0.15.1's model runner order: with
    preemptions `handle_preemptions` (which may block), `start_load_kv` (deferred stores,
    then loads), `wait_for_save` (only with a forward), `get_finished`."""
    from vllm.v1.outputs import KVConnectorOutput

    if out.preempted_req_ids:
        conn.handle_preemptions(out.preempted_req_ids)
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    if out.total_num_scheduled_tokens:
        conn.wait_for_save()  # (`kv_connector_no_forward` passes wait_for_save=False)
    sending, recving = conn.get_finished(out.finished_req_ids)
    conn.clear_connector_metadata()
    # The scheduler frees finished requests' blocks in the order it iterates these (a set of
    # strings: an order that changes with Python's hash seed): in request id order here, as
    # servesim frees them (`OffloadState.apply`).
    return KVConnectorOutput(finished_sending=sorted(sending, key=int) or None,
                             finished_recving=sorted(recving, key=int) or None)


def idle_step(out: Any, kv_output: Any) -> bool:
    """Whether a step with nothing scheduled changes nothing: it started no load, told the
    worker of no finished request, and its poll found no copy done."""
    meta = out.kv_connector_metadata
    if hasattr(meta, "load_jobs"):  # (0.33.0)
        return not (meta.load_jobs or meta.store_jobs or meta.jobs_to_flush
                    or out.finished_req_ids or kv_output.finished_recving
                    or kv_output.kv_connector_worker_meta)
    return not (meta.reqs_to_load or out.finished_req_ids or kv_output.finished_sending
                or kv_output.finished_recving)


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
                                else [rate] * spec["num_speculative_tokens"], workload["seed"],
                                spec.get("match_rate", 1.0))
    admitted_now: dict[int, set[str]] = {}  # per step sent: requests it took from the queue
    # Requests whose drafts came after a step that sampled nothing for them (0.15.1's padded
    # drafter batch proposes for a prompt's unfinished chunk too): none can be accepted.
    blind_drafts: set[str] = set()

    offload = workload["settings"].get("kv_offload")
    conn = copies = None
    if offload:
        conn, copies = worker_connector(
            sched, offload["bytes_per_block"] / (offload["host_bandwidth_gb_s"] * 1e9))

    step = workload["step_time"]
    base_s, per_token_s = step["base_s"], step["per_token_s"]
    arrivals = workload["requests"]
    handles: dict[int, Any] = {}
    times: dict[int, dict[str, Any]] = {}
    steps: list[list[Any]] = []
    async_on = workload["settings"]["async_scheduling"]
    depth = 2 if async_on else 1
    queue: deque[tuple[Any, list[str], float, float, list[Any]]] = deque()  # oldest at right
    kv_outputs: dict[int, Any] = {}  # per step sent: its connector output (the worker's poll)
    reported: list[bool] = []  # per step received: whether its poll found a copy done
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
        nonlocal gpu_free_s, now_s
        del preempted_order[:]
        if copies is not None and copies.v033:
            # 0.33.0's connector stores for, and re-ranks the tier blocks of, the requests
            # finished since the last step in the order of a set of strings, which Python's
            # hash seed decides: in request id order here, as servesim takes them.
            sched.finished_req_ids = IdOrderedSet(sched.finished_req_ids)
        placeholders = {rid: getattr(r, "num_output_placeholders", 0)
                        for rid, r in sched.requests.items()}
        queued = {rid for rid, r in sched.requests.items() if r.status.name != "RUNNING"}
        out = sched.schedule()
        admitted_now[id(out)] = queued & set(out.num_scheduled_tokens)
        scheduled = list(out.num_scheduled_tokens.items())
        samples = [rid for rid, _ in scheduled
                   if _samples(sched.requests[rid], placeholders.get(rid, 0), async_on)]
        total = out.total_num_scheduled_tokens
        launch_s = now_s
        if conn is not None:
            assert copies is not None
            copies.now_s, copies.after_s = now_s, gpu_free_s
            if copies.v033:
                worker_pre_forward(conn, out)
            else:
                kv_outputs[id(out)] = worker_step(conn, out)
            # Later if it waited for a preempted request's copies: the engine's host was
            # blocked until then.
            launch_s = now_s = copies.now_s
        if total:
            start_s = max(launch_s, gpu_free_s)
            end_s = start_s + (base_s + per_token_s * total)
            gpu_free_s = end_s
        else:
            start_s = end_s = launch_s
        if conn is not None and copies is not None and copies.v033:
            copies.after_s = gpu_free_s  # (the compute stream's work, this step's included)
            kv_outputs[id(out)] = worker_post_forward(conn, out)
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
                if not acceptance.matched(int(rid), n):
                    continue  # (async: placeholders where the n-gram lookup found no match)
                num_accepted = acceptance.accepted(int(rid), n, num_spec)
                sampled[i] = [output_token_id(int(rid), n + j) for j in range(num_accepted + 1)]
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled)
        if conn is not None:
            output.kv_connector_output = kv_outputs.pop(id(out))
            reported.append(bool(output.kv_connector_output.finished_sending
                                 or output.kv_connector_output.finished_recving))
        sched.update_from_output(out, output)
        if acceptance is not None and not async_on and out.total_num_scheduled_tokens:
            # `EngineCore.post_step`: the drafter's proposals for the requests of the step.
            # (n-gram lookup proposes nothing for a request that sampled nothing.)
            # (k, or the dynamic schedule's for this step: `num_spec_tokens_to_schedule`)
            k = 0 if getattr(out, "skip_drafts", False) else getattr(
                out, "num_spec_tokens_to_schedule", spec["num_speculative_tokens"])
            blind = [] if spec["method"] == "ngram" else [r for r in req_ids if r not in samples]
            blind_drafts.difference_update(req_ids)
            blind_drafts.update(blind)
            # (An n-gram lookup may find no match: no drafts.)
            sched.update_draft_token_ids(DraftTokenIds(
                req_ids, [[output_token_id(int(rid), 10_000 + j)
                           for j in range(k if (rid in samples and acceptance.matched(
                               int(rid), handles[int(rid)].num_output_tokens))
                               or rid in blind else 0)]
                          for rid in req_ids]))
        for rid in samples:
            req = handles[int(rid)]
            t = times[int(rid)]
            if t["first_token_s"] is None and req.num_output_tokens > 0:
                t["first_token_s"] = now_s
            if t["finish_s"] is None and req.is_finished():
                t["finish_s"] = now_s

    while conn is not None:  # the engine loop with the CPU tier (vLLM's, empty steps too)
        assert copies is not None
        add_arrived()
        if sched.has_requests() and len(queue) < depth:
            send()
            out, entry = queue[0][0], queue[0][4]
            if not entry[2] and not entry[3] and idle_step(out, kv_outputs[id(out)]):
                # An empty step that started nothing and found nothing: it changes nothing
                # (its output is empty), and vLLM's engine steps on, empty, until a copy ends
                # or a request arrives; or, with a batch in flight, blocks on it.
                queue.append(queue.popleft())
                receive()
                steps.pop()
                if queue:
                    receive()
                    continue
                wake_s = min(copies.next_done_s(), arrivals[next_arrival][0]
                             if next_arrival < len(arrivals) else float("inf"))
                if wake_s == float("inf"):
                    if not workload.get("stalls"):
                        raise RuntimeError(f"{workload['name']}: requests left, none can run")
                    break  # (vLLM would step on, empty, for ever)
                now_s = max(now_s, wake_s)
                continue
            if len(queue) < depth and entry[2]:
                continue  # a batch that runs, the queue not full: schedule another at once
        if not queue:  # (nothing to report either: idle until a request arrives)
            if next_arrival == len(arrivals):
                break
            now_s = max(now_s, arrivals[next_arrival][0])
            continue
        receive()
    if conn is not None:  # (empty steps are not iterations: servesim logs none)
        steps[:] = [entry for entry in steps if entry[2] or entry[3]]
    while conn is None:
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
    assert bool(unfinished) == bool(workload.get("stalls")), unfinished[:5]
    assert len(times) == len(arrivals)
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
        only = workload.get("only_release")
        if only is not None and only != vllm.__version__:
            if args.names:
                sys.exit(f"{name}: recorded with vLLM {only} only, not {vllm.__version__}")
            continue
        if isinstance(workload.get("stalls"), str):  # (stalls on the release named only)
            workload = {**workload, "stalls": workload["stalls"] == vllm.__version__}
            if not workload["stalls"]:
                del workload["stalls"]
        body = record(workload)
        path = write_fixture(args.out, workload, body, engine="vllm",
                             engine_version=vllm.__version__,
                             command="python tools/golden/record_vllm.py --out "
                                     f"{args.out} {name}")
        print(f"{name}: {len(body['steps'])} steps -> {path}")


if __name__ == "__main__":
    main()
