"""SGLang's server arguments as the `sglang` policy takes them (`SGLangConfig`), with the
defaults SGLang 0.5.23 resolves (speculative decoding's: `sim.schedulers.sglang_spec`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from sim.config.base import Frozen
from sim.config.errors import invalid
from sim.schedulers.base import SchedulerConfig
from sim.schedulers.sglang_spec import (
    SPEC_MAX_RUNNING_REQUESTS,
    SGLangSpeculativeConfig,
    auto_params,
)

if TYPE_CHECKING:
    from sim.hardware.gpus import GPUSpec

# Releases checked by the golden schedules (`tests/golden/sglang-<version>/`).
SGLANG_VERSIONS = ("0.5.23",)
# Blackwell data-centre GPUs (SM100), where SGLang defaults to TensorRT-LLM's attention.
SM100_GPUS = frozenset({"b200"})
# `chunked_prefill_size` by the GPU's memory: (below this many GiB, tokens), else 16384.
CHUNK_BY_MEMORY_GIB = ((20, 2048), (60, 4096), (160, 8192))
# `handle_data_parallelism` (`arg_groups/parallel_hook.py`): DP attention's conservativeness.
DP_CONSERVATIVENESS_FACTOR = 0.3


class SGLangHiCacheConfig(Frozen):
    """`--enable-hierarchical-cache`: host memory as a second tier below the GPU's radix
    cache (`sim.core.hicache`), with SGLang 0.5.23's defaults (`arg_groups/fields/memory.py`).
    The copies each way run over each GPU's own host link, at `host_bandwidth_gb_s`; with
    speculative decoding they carry the drafter's KV layer too (`sim.engine.hicache`)."""

    ratio: float = Field(
        2.0, gt=0,
        description=("--hicache-ratio: the host pool's tokens over the GPU pool's (SGLang's "
                     "default 2; it lowers it where host memory is short: not modelled)"))
    size_gb: float = Field(
        0.0, ge=0,
        description=("--hicache-size: the host pool per rank in GB (10**9 bytes; a token's "
                     "bytes count an MTP head's layer, packed beside the target's); 0: by the "
                     "ratio"), json_schema_extra={"unit": "GB"})
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = Field(
        "write_through",
        description=("--hicache-write-policy: back a node up to the host at its first "
                     "insertion (write_through), or at its second (write_through_selective), "
                     "or only when it is evicted from the GPU (write_back: the scheduler "
                     "waits for each such copy; a full host first frees its copies of "
                     "prefixes on the GPU, then drops what it cannot take)"))
    host_bandwidth_gb_s: float | None = Field(
        None, gt=0, le=10_000,
        description=("GB/s one GPU copies KV to or from host memory, each way; None: 80% of "
                     "its PCIe x16 link, as for vLLM's CPU tier (replica.kv_offload)"),
        json_schema_extra={"unit": "GB/s"})


class SGLangConfig(SchedulerConfig):
    """SGLang's server arguments that shape scheduling. `max_running_requests` (SGLang's name) is
    accepted for `max_num_seqs`; the resolved scenario spells it `max_num_seqs`."""

    # SGLang keeps its radix cache unless `--disable-radix-cache` is given.
    prefix_caching_default: ClassVar[bool] = True

    chunked_prefill_size: int = Field(
        8192, gt=0,
        description=("--chunked-prefill-size: most new tokens in one prefill (extend) "
                     "batch; unset, SGLang's by the GPU's memory: 2048 below 20 GiB, 4096 "
                     "below 60 (RTX 4090, A10G, L40S), 8192 below 160 (A100, H100, H200, RTX "
                     "PRO 6000), else 16384 (B200, MI300X)"),
        json_schema_extra={"unit": "tokens", "shown_default": "by the GPU"},
    )
    decode_reserve_tokens: int | None = Field(
        None, ge=0,
        description=("None: SGLang's own admission (PrefillAdder: budget remainders, the "
                     "in-order check, the full-batch latch); an integer: admit while the "
                     "chunk fits beside that many future tokens per running request"))
    num_reserved_decode_tokens: int = Field(
        512, ge=0,
        description=("--num-reserved-decode-tokens: on a decode pool, the KV held back for "
                     "each request running or on its way when another's is preallocated "
                     "(`DecodePreallocQueue`)"),
        json_schema_extra={"unit": "tokens"})
    engine_version: str = Field(
        "0.5.23", description=("SGLang release whose rules and defaults apply: 0.5.23 "
                               "(overlap_schedule on)"))
    overlap_schedule: bool = Field(
        True, description=("SGLang's default event loop (off: --disable-overlap-schedule): the "
                           "next batch decided while one runs, two in flight; one stage only"))
    mixed_chunk: bool = Field(
        False,
        description=("--enable-mixed-chunk: running decodes join each prefill batch, one token "
                     "each, counted against chunked_prefill_size"),
    )
    enable_priority_scheduling: bool = Field(
        False, description=("--enable-priority-scheduling: the waiting queue by the requests' "
                            "priority (their class's), higher values first, then by when each "
                            "entered it; a waiting request preempts running ones when the "
                            "batch is full by count; on a decode pool, the preallocation "
                            "queue by priority; disaggregated pools never preempt"))
    schedule_low_priority_values_first: bool = Field(
        False, description=("--schedule-low-priority-values-first: lower values first (a decode "
                            "pool's preallocation queue too)"))
    priority_scheduling_preemption_threshold: int = Field(
        10, ge=0,
        description=("--priority-scheduling-preemption-threshold: a waiting request preempts a "
                     "running one whose priority it beats by more than this (SGLang takes a "
                     "negative one too: requests of one level then preempt each other, "
                     "possibly for ever; refused here); no effect on disaggregated pools"))
    disable_priority_preemption: bool = Field(
        False, description="--disable-priority-preemption: the queue by priority, no preemption")
    speculative: SGLangSpeculativeConfig | None = Field(
        None, description=("--speculative-algorithm and its numbers (rule 12; "
                           "sim.schedulers.sglang_spec); None: off"))
    hierarchical_cache: SGLangHiCacheConfig | None = Field(
        None, description=("--enable-hierarchical-cache and its settings (HiCache: host "
                           "memory below the radix cache, sim.core.hicache; with speculative "
                           "decoding the drafter's KV layer is copied beside the target's, "
                           "a draft model refused); None: off"))

    mem_fraction_static: float | None = Field(
        None, gt=0, le=1,
        description=("--mem-fraction-static: the fraction of each GPU's memory for the weights "
                     "and the KV pool (the rest for activations and CUDA graphs), where "
                     "kv_cache.num_blocks is not given; unset, SGLang's own from the GPU's "
                     "memory, chunked_prefill_size, its decode CUDA graphs and TP x PP "
                     "(sim.schedulers.sglang_memory), spelled out in the resolved scenario"),
        json_schema_extra={"shown_default": "derived by the GPU"})

    schedule_conservativeness: float = Field(
        1.0, gt=0,
        description=("--schedule-conservativeness: scales the share of a running request's "
                     "outputs left that admission reserves KV for (`new_token_ratio`, 0.7 "
                     "times this at first, decaying to 0.14 of that); SGLang multiplies it "
                     "by 0.3 on data-parallel ranks (DP attention)"))
    load_balance_method: Literal["auto", "round_robin", "follow_bootstrap_room",
                                 "total_requests", "total_tokens"] = Field(
        "auto",
        description=("--load-balance-method: which rank of data-parallel ones (DP attention, "
                     "parallelism.data) takes each request (sim.routers.sglang_dp); auto: "
                     "round_robin, on a disaggregated prefill pool follow_bootstrap_room (a "
                     "rank at random)"))

    enable_dp_lm_head: bool = Field(
        False,
        description=("--enable-dp-lm-head (DP attention, parallelism.data > 1): each rank's "
                     "LM head over its own attention TP group, on its own sampled rows; off, "
                     "SGLang splits it over all D x T GPUs (a D x T'th of the vocabulary and "
                     "of its weights each), every rank's rows gathered and their logits "
                     "gathered back (an all-to-all on a decode pool of one GPU a rank)"))

    max_num_seqs: int = Field(
        256, gt=0,
        description=("--max-running-requests: most requests running at once; unset, SGLang "
                     "derives it from the KV pool: tokens / context window x 512, within "
                     "2048-4096 (48 with speculative decoding); at most half the pool's "
                     "tokens, given or not"),
        json_schema_extra={"unit": "requests", "shown_default": "from the KV pool"})

    @classmethod
    def for_gpu(cls, data: dict[str, Any], gpu: GPUSpec, context_len: int | None = None
                ) -> dict[str, Any]:
        # SGLang's chunk size by the GPU's memory (`arg_groups/memory_hook.py`
        # `_handle_gpu_memory_settings`: the device's MiB, 2k below 20 GiB, 4k below 60,
        # 8k below 160, else 16k), spelled out in the resolved scenario.
        if "chunked_prefill_size" in data:
            return data
        memory_gib = gpu.memory_bytes / 2**30
        size = next((s for below_gib, s in CHUNK_BY_MEMORY_GIB if memory_gib < below_gib),
                    16384)
        return {**data, "chunked_prefill_size": size}

    @classmethod
    def page_size(cls, data: dict[str, Any], gpu: GPUSpec | None, mla: bool) -> int | None:
        # `--page-size` unset is 1 (`arg_groups/overrides.py` `_page_size_default`) for the
        # attention backends SGLang picks on most GPUs (FA3 on Hopper, FlashInfer or Triton
        # elsewhere, FlashInfer for MLA on a B200); on a B200 (SM100) a model without MLA
        # gets TensorRT-LLM's MHA unless speculation drafts a tree (`model_override_base.py`
        # `get_default_attn_backend`), which takes pages of 64 (`_mla_backend_page_
        # constraints`).
        spec = data.get("speculative")
        tree = isinstance(spec, dict) and spec.get("eagle_topk", 1) != 1
        sm100 = gpu is not None and gpu.measured_as in SM100_GPUS
        return 64 if sm100 and not mla and not tree else 1

    @property
    def derives_from_kv(self) -> bool:
        return True  # the running limit, given or not: at most half the pool (`for_kv`)

    def for_kv(self, num_kv_tokens: int, context_len: int | None, num_ranks: int = 1
               ) -> SGLangConfig:
        # `KVCacheConfigurator.resolve_max_num_reqs` (`mem_cache/kv_cache_configurator.py`):
        # unset, the pool's tokens over the context window times 512, within 2048-4096;
        # given, a DP-attention rank's share of it (`// attn_dp_size`); either way at most
        # half one rank's pool. Spelled out as the replica's total (the share times the
        # ranks), as `--max-running-requests` is given.
        num_seqs = self.max_num_seqs
        given = "max_num_seqs" in self.model_fields_set
        if given:
            num_seqs = max(1, num_seqs // num_ranks)
        elif context_len:
            num_seqs = max(min(int(num_kv_tokens / context_len * 512), 4096), 2048)
        num_seqs = max(1, min(num_seqs, num_kv_tokens // 2)) * num_ranks
        if num_seqs == self.max_num_seqs and given:
            return self
        return self.model_copy(update={"max_num_seqs": num_seqs})

    def for_rank(self, num_ranks: int) -> SGLangConfig:
        # DP attention (`arg_groups/parallel_hook.py` `handle_data_parallelism`): each rank
        # prefills `--chunked-prefill-size // attn_dp_size` tokens at most, runs its share of
        # `--max-running-requests` (`for_kv`) and reserves for decodes at 0.3 times the
        # conservativeness.
        if num_ranks == 1:
            return self
        return self.model_copy(update={
            "chunked_prefill_size": max(1, self.chunked_prefill_size // num_ranks),
            "max_num_seqs": max(1, self.max_num_seqs // num_ranks),
            "schedule_conservativeness": self.schedule_conservativeness
            * DP_CONSERVATIVENESS_FACTOR})

    @classmethod
    def for_model(cls, data: dict[str, Any], model_type: str | None) -> dict[str, Any]:
        # SGLang's (S, K, D) for the target where none is given (`_auto_choose_speculative_
        # params`), spelled out in the resolved scenario.
        spec = data.get("speculative")
        if not isinstance(spec, dict) or any(
                k in spec for k in ("num_steps", "eagle_topk", "num_draft_tokens")):
            return data
        auto = auto_params(str(spec.get("algorithm")), model_type)
        if auto is None:
            return data  # (refused by the speculative settings' own check)
        steps, topk, draft = auto
        return {**data, "speculative": {**spec, "num_steps": steps, "eagle_topk": topk,
                                        "num_draft_tokens": draft}}

    @model_validator(mode="before")
    @classmethod
    def _max_running_requests(cls, data: Any) -> Any:
        if (isinstance(data, dict) and data.get("speculative") is not None
                and "max_running_requests" not in data and "max_num_seqs" not in data):
            # "Max running requests is reset to 48 for speculative decoding" (unless given).
            data = {**data, "max_num_seqs": SPEC_MAX_RUNNING_REQUESTS}
        if not isinstance(data, dict) or "max_running_requests" not in data:
            return data
        data = dict(data)
        value = data.pop("max_running_requests")
        if type(value) is not int or value <= 0:  # not a bool: strict validation refuses it
            raise invalid(("max_running_requests", value, "must be a positive integer"))
        if data.setdefault("max_num_seqs", value) != value:
            raise invalid(("max_running_requests", value, "is SGLang's name for max_num_seqs "
                           f"({data['max_num_seqs']}): give one of them"))
        return data

    @model_validator(mode="after")
    def _known_version(self) -> SGLangConfig:
        if self.engine_version not in SGLANG_VERSIONS:
            raise invalid(("engine_version", self.engine_version,
                           f"unknown SGLang version; known: {', '.join(SGLANG_VERSIONS)}"))
        if self.priority_preemption and self.decode_reserve_tokens is not None:
            raise invalid(("decode_reserve_tokens", self.decode_reserve_tokens,
                           "replaces SGLang's admission (PrefillAdder), which priority "
                           "preemption is part of: leave it unset, or give "
                           "disable_priority_preemption: true"))
        if self.hierarchical_cache is not None:
            if self.speculative is not None and self.speculative.algorithm == "standalone":
                raise invalid(("speculative.algorithm", "standalone",
                               "with the hierarchical cache SGLang backs up the draft model's "
                               "KV beside the target's, whose size servesim does not know: "
                               "not modelled (servesim issue 47)"))
            if self.decode_reserve_tokens is not None:
                raise invalid(("decode_reserve_tokens", self.decode_reserve_tokens,
                               "replaces SGLang's admission, where the hierarchical cache "
                               "loads prefixes back: leave it unset"))
        if self.speculative is not None:
            if self.mixed_chunk:
                raise invalid(("mixed_chunk", True,
                               "with speculative decoding SGLang turns it off for standalone "
                               "and ngram, and runs decodes unverified beside prompts for the "
                               "EAGLE family: not modelled (servesim issue 47)"))
            if self.decode_reserve_tokens is not None:
                raise invalid(("decode_reserve_tokens", self.decode_reserve_tokens,
                               "replaces SGLang's admission, which speculative decoding's KV "
                               "rule is modelled with: leave it unset"))
        return self

    def kv_block_problems(self, block_size: int) -> list[tuple[str, Any, str]]:
        # SGLang's page is servesim's KV block. Its paged rules are golden-checked without
        # speculative decoding, the hierarchical cache and mixed chunks only. (An integer
        # `decode_reserve_tokens` replaces its admission: no page there.)
        if block_size == 1 or self.decode_reserve_tokens is not None:
            return []
        if self.chunked_prefill_size % block_size:
            return [("chunked_prefill_size", self.chunked_prefill_size,
                     f"SGLang asks for whole pages of kv_cache.block_size ({block_size}) "
                     "(`chunked_prefill_size must be divisible by page_size`)")]
        unmodelled = [name for name, on in (
            ("speculative decoding", self.speculative is not None),
            ("the hierarchical cache", self.hierarchical_cache is not None),
            ("mixed_chunk", self.mixed_chunk)) if on]
        if not unmodelled:
            return []
        return [("kv_cache.block_size", block_size,
                 f"SGLang pages of more than 1 token with {' and '.join(unmodelled)} are not "
                 "modelled: give block_size 1")]

    @property
    def max_running_requests(self) -> int:
        return self.max_num_seqs

    @property
    def given_max_running_requests(self) -> int | None:
        """`--max-running-requests` as the scenario gives it, None where SGLang derives it
        (speculative decoding's 48 is SGLang's own: set after the memory settings are)."""
        if "max_num_seqs" not in self.model_fields_set:
            return None
        if self.speculative is not None and self.max_num_seqs == SPEC_MAX_RUNNING_REQUESTS:
            return None
        return self.max_num_seqs

    @property
    def priority_preemption(self) -> bool:
        """SGLang's `enable_priority_preemption`: on with priority scheduling, unless
        disabled."""
        return self.enable_priority_scheduling and not self.disable_priority_preemption
