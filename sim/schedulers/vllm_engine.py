"""The installed vLLM's own scheduler inside servesim's engine (`scheduler: {name: vllm_engine}`).

Exact by construction for the vLLM release installed, and slower than `vllm_v1`: every plan is
vLLM's `Scheduler.schedule()` (or `AsyncScheduler`'s), every ended iteration goes back through
`update_from_output` with one sampled token per request it caught up. servesim keeps owning
time, clusters, routing, latency models and results; vLLM decides the batches.

vLLM is optional (it pins its own CUDA torch; servesim never installs it): without it a
scenario naming this policy is refused in one line. The scheduler is built as vLLM's tests
build it (a one-layer Llama `config.json` in a temporary folder, `skip_tokenizer_init`, a
`KVCacheConfig` of the replica's blocks plus vLLM's null block), the first time it plans.
Requests carry synthetic token ids: tokens under the same prefix-block ids are equal, so vLLM's
prefix cache shares exactly what servesim's ids share; other tokens are the request's own.
The replica's KV manager mirrors vLLM's allocations (a disagreement is an error, not a guess).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from sim.config.errors import invalid
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.schedulers.base import SCHEDULERS, Scheduler, SchedulerConfig
from sim.schedulers.vllm_v1 import unchunked_reason

_VOCAB = 32_000
_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 1, "vocab_size": _VOCAB, "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


class VllmEngineConfig(SchedulerConfig):
    """vLLM's own scheduler settings, by vLLM's names."""

    max_num_batched_tokens: int = Field(8192, gt=0, description="vLLM's token budget")
    max_num_seqs: int = Field(256, gt=0, description="most requests running at once")
    enable_chunked_prefill: bool = Field(True, description="False: prompts prefilled whole")
    long_prefill_token_threshold: int = Field(0, ge=0, description="largest chunk; 0: no cap")
    async_scheduling: bool = Field(True, description="two iterations in flight (vLLM default)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM's --scheduling-policy (priority: by the requests' priority)")
    decode_reserve_tokens: int | None = Field(0, ge=0, le=0, description="vLLM reserves none")

    @model_validator(mode="after")
    def _vllm_installed(self) -> VllmEngineConfig:
        if importlib.util.find_spec("vllm") is None:
            raise invalid(("name", "vllm_engine", "needs vLLM installed beside servesim "
                           "(pip install vllm); vllm_v1 reproduces 0.15.1 and 0.33.0 without it"))
        return self

    @classmethod
    def for_pipeline(cls, data: dict[str, Any], pipeline_size: int) -> dict[str, Any]:
        if pipeline_size > 1 and data.get("async_scheduling", True):
            raise invalid(("async_scheduling", True, "vLLM's V1 model runner does not "
                           f"schedule asynchronously on a pipeline ({pipeline_size} stages)"))
        return data


@SCHEDULERS.register("vllm_engine")
class VllmEngine(Scheduler):
    """Plans are the installed vLLM scheduler's (module docstring)."""

    Config = VllmEngineConfig
    config: VllmEngineConfig
    num_null_blocks = 1
    delivers_stale_tokens = True  # `update_from_output`: "still delivered on return"
    allows_stretches = False  # vLLM must see every iteration end

    def __init__(self, config: VllmEngineConfig, *, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len=max_model_len)
        self._sched: Any = None
        self._known: dict[int, Any] = {}  # servesim request id -> vLLM Request
        self._sent: dict[int, tuple[Any, list[str]]] = {}  # id(plan) -> output, samplers
        self._preempted: list[str] = []

    def capacity_reason(self, kv: Any, num_kv_tokens: int) -> str | None:
        return super().capacity_reason(kv, num_kv_tokens) or unchunked_reason(
            self.config.enable_chunked_prefill, self.config.max_num_batched_tokens,
            num_kv_tokens)

    def num_batches_in_flight(self, pipeline_size: int) -> int:
        return max(2, pipeline_size) if self.config.async_scheduling else pipeline_size

    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"  # vLLM's own queue order, mirrored

    @property
    def output_placeholders(self) -> bool:
        return self.config.async_scheduling

    # -- building vLLM's scheduler ---------------------------------------------------------

    def _build(self, state: ReplicaState) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            VllmConfig,
        )
        from vllm.config import (
            SchedulerConfig as VSchedulerConfig,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # (vLLM's torch, not ours)
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler as VScheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        cfg, kv = self.config, state.kv
        max_model_len = self.max_model_len or 1 << 20
        if not cfg.enable_chunked_prefill:
            max_model_len = min(max_model_len, cfg.max_num_batched_tokens)
        caching = kv.caches_prefixes
        vllm_sched = VSchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            async_scheduling=cfg.async_scheduling, is_encoder_decoder=False,
            policy=cfg.scheduling_policy)
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "config.json").write_text(json.dumps(_LLAMA))
            model = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float16",
                                seed=0, max_model_len=max_model_len)
            cache = CacheConfig(block_size=kv.block_size, enable_prefix_caching=caching)
            vllm_config = VllmConfig(scheduler_config=vllm_sched, model_config=model,
                                     cache_config=cache, device_config=DeviceConfig("cpu"))
            num_blocks = kv.num_blocks + self.num_null_blocks
            kv_config = KVCacheConfig(
                num_blocks=num_blocks, kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                    block_size=kv.block_size, num_kv_heads=1, head_size=1,
                    dtype=STR_DTYPE_TO_TORCH_DTYPE["float32"]))])
            cache.num_gpu_blocks = num_blocks
            self._hasher = None
            if caching:
                hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
                init_none_hash(hash_fn)
                self._hasher = get_request_block_hasher(kv.block_size, hash_fn)
            cls = AsyncScheduler if cfg.async_scheduling else VScheduler
            extra = {"block_size": kv.block_size} if "block_size" in _params(VScheduler) else {}
            self._sched = cls(vllm_config=vllm_config, kv_cache_config=kv_config,
                              log_stats=False,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              **extra)
        original = self._sched._preempt_request

        def preempt(request: Any, *args: Any, **kwargs: Any) -> None:
            self._preempted.append(request.request_id)
            original(request, *args, **kwargs)

        self._sched._preempt_request = preempt

    def _vllm_request(self, req: Request) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as VRequest

        params = SamplingParams(max_tokens=req.num_target_output_tokens, ignore_eos=True)
        extra = {"eos_token_id": 2} if "eos_token_id" in _params(VRequest) else {}
        return VRequest(str(req.request_id), prompt_token_ids=prompt_tokens(req),
                        sampling_params=params, pooling_params=None,
                        arrival_time=req.arrival_s, block_hasher=self._hasher,
                        priority=req.priority, **extra)

    # -- planning -------------------------------------------------------------------------

    @property
    def max_num_scheduled_tokens(self) -> int | None:
        return self.config.max_num_batched_tokens

    def decide(self, state: ReplicaState, now_s: float) -> Plan:
        if self._sched is None:
            self._build(state)
        sched = self._sched
        for req in state.waiting:
            if req.request_id not in self._known:
                self._known[req.request_id] = vreq = self._vllm_request(req)
                sched.add_request(vreq)
        preempted: list[int] = []
        while True:
            placeholders = {rid: getattr(r, "num_output_placeholders", 0)
                            for rid, r in sched.requests.items()}
            self._preempted = []
            out = sched.schedule()
            preempted += self._mirror_preemptions(state)
            scheduled = list(out.num_scheduled_tokens.items())
            if scheduled:
                break
            sched.update_from_output(out, _empty_output())  # nothing ran: no time passes
            if not self._preempted:
                return Plan(preempted_ids=preempted)
        plan = Plan(preempted_ids=preempted)
        samplers = []
        for rid, num_tokens in scheduled:
            vreq = sched.requests[rid]
            req = state.requests[int(rid)]
            computed_before = vreq.num_computed_tokens - num_tokens
            if req in state.waiting:
                cached = computed_before - req.num_computed_tokens
                if not state.kv.try_allocate(req, num_tokens, 0, cached):
                    raise RuntimeError(f"request {rid}: servesim's KV accounting refuses "
                                       "what vLLM allocated")
                state.admit(req, cached)
            elif not state.kv.try_allocate(req, num_tokens):
                raise RuntimeError(f"request {rid}: servesim's KV accounting refuses what "
                                   "vLLM allocated")
            plan.num_scheduled_tokens[int(rid)] = num_tokens
            if _samples(vreq, placeholders.get(rid, 0), self.config.async_scheduling):
                samplers.append(rid)
        self._sent[id(plan)] = (out, samplers)
        return plan

    def _mirror_preemptions(self, state: ReplicaState) -> list[int]:
        ids = [int(rid) for rid in self._preempted]
        for rid in ids:
            state.preempt(state.requests[rid])
        return ids

    def requests_aborted(self, requests: list[Request]) -> None:
        from vllm.v1.request import RequestStatus

        if self._sched is not None:
            ids = [str(r.request_id) for r in requests if r.request_id in self._known]
            self._sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def iteration_ended(self, plan: Plan) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        out, samplers = self._sent.pop(id(plan))
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            vreq = self._sched.requests.get(rid)
            index = 0 if vreq is None else vreq.num_output_tokens + getattr(
                vreq, "num_output_placeholders", 0)
            sampled.append([1 + (int(rid) * 7919 + index * 104_729) % (_VOCAB - 1)]
                           if rid in samplers else [])
        self._sched.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled))


def prompt_tokens(req: Request) -> list[int]:
    """Synthetic token ids: a token under prefix-block id i at offset k is the same in every
    request with that id there; the rest are the request's own."""
    ids, h = req.hash_ids or (), req.hash_block_tokens
    tokens = []
    for t in range(req.num_prompt_tokens):
        key = (ids[t // h], t % h) if ids and t // h < len(ids) else (-1, req.request_id, t)
        tokens.append(1 + hash(key) % (_VOCAB - 1))
    return tokens


def _samples(vreq: Any, placeholders_before: int, async_on: bool) -> bool:
    flag = getattr(vreq, "is_prefill_chunk", None)
    if flag is not None:
        return not flag
    if async_on:
        return bool(vreq.num_output_placeholders > placeholders_before)
    return bool(vreq.num_computed_tokens >= vreq.num_tokens)


def _empty_output() -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=[], req_id_to_index={})


def _params(cls: Any) -> Any:
    import inspect

    return inspect.signature(cls.__init__).parameters
