"""vLLM v1's settings as `vllm_v1` takes them, and what each vLLM release does where releases
differ (`EngineRules`, `ENGINE_VERSIONS`): the rules 11-17 of `sim.schedulers.vllm_v1`'s
docstring, and vLLM's server defaults by GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from sim.config.errors import invalid
from sim.hardware.gpus import GPUSpec
from sim.schedulers.base import SchedulerConfig
from sim.schedulers.spec_config import AcceptanceSettings

# vLLM `EngineArgs.get_batch_defaults` (vllm/engine/arg_utils.py): an OpenAI-compatible server on
# a GPU of 70 GiB or more other than an A100 (H100, H200; servesim's default GPU is an H100)
# gets 8192; a replica's GPU picks its own (`EngineRules.batch_defaults`); these apply where no
# GPU is known.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class EngineRules:
    """What a vLLM release does where releases differ (rules 11-17 of `sim.schedulers.vllm_v1`)."""

    # `long_prefill_token_threshold` not applied while one request is running or waiting.
    threshold_spares_lone_request: bool
    # Default of `scheduler_reserve_full_isl` (None: the release has no such setting, off).
    reserve_full_isl: bool | None
    # Default of `async_scheduling` (`VllmConfig.__post_init__` resolves None to it).
    async_scheduling: bool
    # Where freed blocks go in the free queue (`block_pool.py`, `free_blocks`):
    # `sim.core.block_cache`.
    free_order: Literal["lru_block", "fifo_block"]
    # Rule 17: the priority policy's running pass goes on past a request that preempted
    # itself, and keeps its place by the victim's position (else: by whether it was scheduled).
    priority_pass_goes_on: bool
    # `EngineArgs.get_batch_defaults`, an OpenAI-compatible server: the budget on a GPU of
    # 160 GiB or more (None: no such tier in this release, it gets the 70 GiB one's).
    huge_gpu_budget: int | None = None
    # Rule 18, speculative decoding, as the V2 model runner era schedules it (0.33.0): an
    # input budget with draft slots, lookahead at admission, padded decodes from the queue,
    # drafting skipped when unused, lookahead block hashes (no hit block dropped); else
    # 0.15.1's (drafts for a prompt's unfinished chunk, EAGLE's last hit block dropped).
    spec_v2_rules: bool = False
    # Data-parallel ranks of an MoE model: every step's token counts padded to the largest
    # rank's wherever CUDA graphs are configured, eager steps too (0.15.1's
    # `gpu_model_runner.py`: `allow_dp_padding = cudagraph_mode != NONE`); else only steps
    # that fit a CUDA graph (0.19 on: the synced runtime mode; `sim.engine.data_parallel`).
    dp_pads_every_step: bool = False

    def batch_defaults(self, gpu: GPUSpec) -> tuple[int, int]:
        """vLLM's server defaults of `max_num_batched_tokens` and `max_num_seqs` on `gpu`:
        8192 and 1024 on a GPU of 70 GiB or more that is not an A100 (H100, H200), 2048 and
        256 on the others; 0.33.0 gives 16384 from 160 GiB (B200, MI300X)."""
        memory_gib = gpu.memory_bytes / 2**30
        if self.huge_gpu_budget is not None and memory_gib >= 160:
            return self.huge_gpu_budget, 1024
        if memory_gib >= 70 and "a100" not in gpu.name.lower():
            return 8192, 1024
        return 2048, 256


# KV block sizes of DeepSeek's latent attention (MLA) by (release, GPU) where not 16, as each
# release's attention backend for it needs them: 0.15.1 forces FlashMLA's 64 on Hopper and
# FlashInfer MLA's 64 on B200 (`platforms/cuda.py` `check_and_update_config`); 0.33.0 takes its
# backend's preferred size (`update_block_size_for_backend`): FlashAttention MLA's 16 on Hopper,
# FlashInfer MLA's smallest, 32, on B200. Elsewhere (A100, Ada, RTX PRO 6000: Triton MLA) 16.
MLA_BLOCK_SIZES = {("0.15.1", "h100-sxm"): 64, ("0.15.1", "h200"): 64, ("0.15.1", "b200"): 64,
                   ("0.33.0", "b200"): 32}


# Checked against each release's own scheduler code by the golden schedules (`tools/golden/`).
ENGINE_VERSIONS: dict[str, EngineRules] = {
    # The release the public H100 measurements ran (`../shared/realruns/`): async scheduling
    # already on by default (`config/vllm.py`: None -> True with the uni or mp executor); no
    # full-prompt admission check; the threshold always applies (`scheduler.py` ~375).
    "0.15.1": EngineRules(threshold_spares_lone_request=False, reserve_full_isl=None,
                          async_scheduling=True, free_order="fifo_block",
                          priority_pass_goes_on=False, dp_pads_every_step=True),
    # `scheduler.py` ~753-763: "When it is the only request there is nobody to starve";
    # `config/scheduler.py`: `scheduler_reserve_full_isl: bool = True`.
    "0.33.0": EngineRules(threshold_spares_lone_request=True, reserve_full_isl=True,
                          async_scheduling=True, free_order="lru_block",
                          priority_pass_goes_on=True, huge_gpu_budget=16384,
                          spec_v2_rules=True),
}
DEFAULT_ENGINE_VERSION = "0.15.1"


# Speculative methods modelled, as vLLM names them (`SpeculativeConfig.method`): n-gram
# prompt lookup (no draft model, no KV of its own) and the drafters that write KV ahead.
SPEC_METHODS = ("ngram", "eagle", "eagle3", "mtp", "draft_model")


class SpeculativeConfig(AcceptanceSettings):
    """vLLM's `--speculative-config`: a drafter proposes `num_speculative_tokens` tokens after
    each step that samples, and the next step verifies them with its decode (1 + k tokens
    computed, the accepted ones plus one sampled). The scheduler's rules are rule 18 of
    `sim.schedulers.vllm_v1`; the drafter's time is `draft_time_ratio` of a decode step."""

    method: Literal["ngram", "eagle", "eagle3", "mtp", "draft_model"] = Field(
        description="vLLM's method: ngram (prompt lookup), eagle, eagle3, mtp (a one-module "
                    "MTP head), draft_model (a smaller model of the same vocabulary)")
    num_speculative_tokens: int = Field(gt=0, le=16, description="drafts proposed per step",
                                        json_schema_extra={"unit": "tokens"})
    draft_time_ratio: float | None = Field(
        None, ge=0, le=10,
        description="time of one drafting pass over the batch's decodes relative to the "
                    "target's decode step of that batch; None: 0 for ngram (host-side lookup), "
                    "the drafter's share of the weights for eagle/eagle3/mtp (one decoder "
                    "layer and the LM head; over prompt tokens one layer of the target's); "
                    "draft_model needs it")
    num_speculative_tokens_per_batch_size: list[list[int]] | None = Field(
        None, description="vLLM 0.33.0's dynamic speculative decoding: [[first, last, k], "
                          "...], inclusive ranges of the step's scheduled requests from 1, "
                          "each with the drafts proposed after such a step (at most "
                          "num_speculative_tokens; gaps and the tail keep the last k)")
    match_rate: float = Field(
        1.0, gt=0, le=1,
        description="ngram only: the chance a step's prompt lookup finds a match and proposes "
                    "drafts (vLLM's spec-decode num_drafts over decode steps, synchronous); "
                    "acceptance applies to steps with a match. 1: every step proposes")

    engine = "vllm"

    def _positions(self) -> tuple[int, str]:
        return self.num_speculative_tokens, "num_speculative_tokens"

    @model_validator(mode="after")
    def _draft_model_time(self) -> SpeculativeConfig:
        if self.method == "draft_model" and self.draft_time_ratio is None:
            raise invalid(("draft_time_ratio", None, "a draft model's time is its own: give "
                                                     "its step time relative to the target's"))
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is not None:
            problem = _dynamic_schedule_problem(schedule)
            if problem is not None:
                raise invalid(("num_speculative_tokens_per_batch_size", schedule, problem))
        if self.match_rate != 1.0 and self.method != "ngram":
            raise invalid(("match_rate", self.match_rate, f"a {self.method} drafter proposes "
                                                          "at every step: only ngram lookups "
                                                          "may find no match"))
        return self

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots allocated past the tokens scheduled (`VllmConfig.num_lookahead_tokens`):
        the drafters that write KV of their own write it ahead."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    def drafts_by_batch_size(self, max_num_seqs: int) -> tuple[int, ...] | None:
        """vLLM's dense lookup of the dynamic schedule (`build_dynamic_sd_schedule_lookup`):
        entry n, the drafts proposed after a step of n scheduled requests (entry 0 unused),
        each at most k; a gap or the tail carries the k before it. None: k always."""
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None:
            return None
        k = self.num_speculative_tokens
        dense = [0] * (max_num_seqs + 1)
        last = None
        next_size = 1
        for first, end, drafts in sorted(schedule):
            if last is not None:
                for n in range(next_size, min(first, max_num_seqs + 1)):
                    dense[n] = min(k, last)
            for n in range(max(first, next_size), min(end, max_num_seqs) + 1):
                dense[n] = min(k, drafts)
            next_size = max(next_size, end + 1)
            last = drafts
            if next_size > max_num_seqs:
                break
        assert last is not None
        for n in range(next_size, max_num_seqs + 1):
            dense[n] = min(k, last)
        return tuple(dense)

    @property
    def num_draft_slots(self) -> int:
        """0.33.0's `max_num_new_slots_for_drafting`: budget rows a scheduled request's
        drafter adds (a draft model keeps one unsliced input token)."""
        return 1 if self.method == "draft_model" else 0


class VllmV1Config(SchedulerConfig):
    # vLLM v1 caches prefixes by default (`CacheConfig.enable_prefix_caching = True`, 0.15.1
    # and 0.33.0).
    prefix_caching_default: ClassVar[bool] = True
    max_num_batched_tokens: int = Field(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, gt=0,
        description=("most tokens (prefill + decode) an iteration; unset, it and max_num_seqs "
                     "are vLLM's server defaults for the replica's GPU: 8192 and 1024 on an "
                     "H100/H200, 2048 and 256 on an A100, L40S or smaller (docs/schedulers.md)"))
    enable_chunked_prefill: bool = Field(True, description="False: prompts are prefilled whole")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="largest chunk a request computes per iteration; 0: no cap",
        json_schema_extra={"unit": "tokens"})
    max_num_partial_prefills: int | None = Field(
        None, gt=0, description="requests part-way through prefill at once; None: no limit (v1)")
    max_long_partial_prefills: int | None = Field(
        None, gt=0, description="of those, longer than the threshold; None: no limit (v1)")
    min_chunk_tokens: int | None = Field(
        None, gt=0, description="smallest chunk that does not finish a prefill; None: any")
    decode_reserve_tokens: int | None = Field(
        0, ge=0, description="KV slots kept per running request when admitting: 0 as in vLLM")
    engine_version: str = Field(
        DEFAULT_ENGINE_VERSION,
        description=("vLLM release whose rules and defaults apply: "
                     + "; ".join(f"{v} (async_scheduling {'on' if r.async_scheduling else 'off'}"
                                 f", scheduler_reserve_full_isl "
                                 f"{'n/a' if r.reserve_full_isl is None else r.reserve_full_isl}"
                                 f", threshold spares a lone request "
                                 f"{r.threshold_spares_lone_request})"
                                 for v, r in ENGINE_VERSIONS.items())))
    async_scheduling: bool | None = Field(
        None, description=("two iterations in flight, the next scheduled while one runs "
                           "(output placeholders); None: the engine version's default"))
    data_parallel_padding: Literal["every_step", "graph_steps"] | None = Field(
        None, description=("with data-parallel ranks (parallelism.data > 1): each step's "
                           "token counts padded to the largest rank's every step (vLLM 0.15.1 "
                           "with CUDA graphs on), or only where every rank's step fits a CUDA "
                           "graph (vLLM 0.19 on); None: the engine version's"))
    scheduler_reserve_full_isl: bool | None = Field(
        None, description=("admit a request only if blocks for its whole prompt (after its "
                           "prefix hit) are free; None: the engine version's default"))
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description=("vLLM's --scheduling-policy: fcfs, or priority (the queue by "
                             "request priority, lower first, then arrival; the lowest "
                             "priority preempted first)"))
    speculative: SpeculativeConfig | None = Field(
        None, description="vLLM's --speculative-config (rule 18); None: off")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # Unless given, no more running requests than the budget has tokens (vLLM requires it),
        # so that a small budget alone just works.
        if "max_num_seqs" not in data:
            budget = data.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
            if type(budget) is int and budget > 0:  # not a bool: strict validation refuses it
                data = {**data, "max_num_seqs": min(DEFAULT_MAX_NUM_SEQS, budget)}
        # The engine version's defaults, spelled out in the resolved scenario.
        version = data.get("engine_version", DEFAULT_ENGINE_VERSION)
        rules = ENGINE_VERSIONS.get(version) if isinstance(version, str) else None
        if rules is None:
            raise invalid(("engine_version", version,
                           f"unknown vLLM version; known: {', '.join(ENGINE_VERSIONS)}"))
        # 0.15.1 schedules asynchronously only with EAGLE/MTP drafters (`VllmConfig.
        # __post_init__`: "async scheduling is only supported with EAGLE/MTP kind of
        # speculative decoding"), resolving the default off otherwise; 0.33.0's V2 model
        # runner takes every method modelled here.
        spec = data.get("speculative")
        method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
        async_refused = (version == "0.15.1" and method is not None
                         and method not in ("eagle", "eagle3", "mtp"))
        if data.get("async_scheduling") is None:
            data = {**data, "async_scheduling": rules.async_scheduling and not async_refused}
        elif data["async_scheduling"] is True and async_refused:
            raise invalid(("async_scheduling", True, f"vLLM {version} schedules "
                           f"asynchronously only with EAGLE/MTP drafters, not {method}"))
        if data.get("scheduler_reserve_full_isl") is None:
            data = {**data, "scheduler_reserve_full_isl": bool(rules.reserve_full_isl)}
        elif rules.reserve_full_isl is None and data["scheduler_reserve_full_isl"] is True:
            raise invalid(("scheduler_reserve_full_isl", True,
                           f"vLLM {version} has no such setting (added later: 0.33.0 has it)"))
        return data

    @classmethod
    def for_gpu(cls, data: dict[str, Any], gpu: GPUSpec, context_len: int | None = None
                ) -> dict[str, Any]:
        # The server's batch defaults by GPU (`EngineRules.batch_defaults`); without chunking
        # the budget is at least the context window (`_set_default_max_num_seqs_and_batched_
        # tokens_args`: max(max_model_len, default)); max_num_seqs no more than the budget,
        # as `_defaults` keeps it.
        version = data.get("engine_version", DEFAULT_ENGINE_VERSION)
        rules = ENGINE_VERSIONS.get(version) if isinstance(version, str) else None
        if rules is None or ("max_num_batched_tokens" in data and "max_num_seqs" in data):
            return data  # (an unknown version: `_defaults` says so)
        budget, num_seqs = rules.batch_defaults(gpu)
        if data.get("enable_chunked_prefill") is False and context_len is not None:
            budget = max(budget, context_len)
        out = {"max_num_batched_tokens": budget, **data}
        if "max_num_seqs" not in data and type(out["max_num_batched_tokens"]) is int:
            out["max_num_seqs"] = max(1, min(num_seqs, out["max_num_batched_tokens"]))
        return out

    @classmethod
    def page_size(cls, data: dict[str, Any], gpu: GPUSpec | None, mla: bool) -> int | None:
        # DeepSeek's latent attention takes the block size of the backend vLLM picks for it
        # (`MLA_BLOCK_SIZES`); other models vLLM's 16.
        if not mla or gpu is None:
            return None
        version = data.get("engine_version", DEFAULT_ENGINE_VERSION)
        return MLA_BLOCK_SIZES.get((version, gpu.measured_as)) if isinstance(version, str) \
            else None

    @classmethod
    def page_refused(cls, data: dict[str, Any], gpu: GPUSpec | None, mla: bool,
                     block_size: int) -> str | None:
        # 0.15.1 replaces a size its MLA backend cannot take, given or not (0.33.0 keeps a
        # given one and picks a backend that takes it).
        page = cls.page_size(data, gpu, mla)
        if page is None or data.get("engine_version", DEFAULT_ENGINE_VERSION) != "0.15.1" \
                or block_size % page == 0:
            return None
        return (f"vLLM 0.15.1 runs DeepSeek's latent attention on {gpu.name if gpu else ''} "
                f"with blocks of {page} whatever is given: give a multiple of {page}, or leave "
                "it unset")

    @classmethod
    def for_pipeline(cls, data: dict[str, Any], pipeline_size: int) -> dict[str, Any]:
        # `VllmConfig.__post_init__` resolves async scheduling off on a pipeline (the V1 model
        # runner's "pipeline parallelism" incompatibility) and refuses it asked for there.
        if pipeline_size <= 1:
            return data
        if data.get("async_scheduling") is None:
            return {**data, "async_scheduling": False}
        if data["async_scheduling"] is True:
            raise invalid(("async_scheduling", True, "vLLM's V1 model runner does not "
                           f"schedule asynchronously on a pipeline ({pipeline_size} stages)"))
        return data

    @property
    def rules(self) -> EngineRules:
        return ENGINE_VERSIONS[self.engine_version]

    @property
    def pads_every_step(self) -> bool:
        """Whether data-parallel ranks pad every step (`data_parallel_padding`)."""
        if self.data_parallel_padding is None:
            return self.rules.dp_pads_every_step
        return self.data_parallel_padding == "every_step"

    @model_validator(mode="after")
    def _consistent(self) -> VllmV1Config:
        budget, threshold = self.max_num_batched_tokens, self.long_prefill_token_threshold
        problems: list[tuple[str, Any, str]] = []
        if self.max_num_seqs > budget:  # vLLM's verify_max_model_len refuses it too
            problems.append(("max_num_seqs", self.max_num_seqs,
                             f"must not exceed max_num_batched_tokens ({budget})"))
        if not self.enable_chunked_prefill:
            problems += [(name, value, "needs enable_chunked_prefill") for name, value in (
                ("long_prefill_token_threshold", threshold or None),
                ("max_num_partial_prefills", self.max_num_partial_prefills),
                ("max_long_partial_prefills", self.max_long_partial_prefills),
                ("min_chunk_tokens", self.min_chunk_tokens)) if value is not None]
        if self.max_long_partial_prefills is not None and not threshold:
            problems.append(("max_long_partial_prefills", self.max_long_partial_prefills,
                             "needs long_prefill_token_threshold to say what is long"))
        most, most_long = self.max_num_partial_prefills, self.max_long_partial_prefills
        if most is not None and most_long is not None and most_long > most:
            problems.append(("max_long_partial_prefills", most_long,
                             f"must not exceed max_num_partial_prefills ({most})"))
        # A minimum above every chunk a long prompt can get would stall it for ever.
        largest_chunk = min(budget, threshold) if threshold else budget
        if self.min_chunk_tokens is not None and self.min_chunk_tokens > largest_chunk:
            problems.append(("min_chunk_tokens", self.min_chunk_tokens,
                             f"must not exceed the largest chunk ({largest_chunk}: "
                             "max_num_batched_tokens or long_prefill_token_threshold)"))
        spec = self.speculative
        if (spec is not None and self.rules.spec_v2_rules
                and budget <= spec.num_lookahead_tokens):
            # `VllmConfig._set_max_num_scheduled_tokens`: "does not have enough slots to
            # schedule a token and support the speculative decoding settings"
            problems.append(("max_num_batched_tokens", budget,
                             f"vLLM {self.engine_version} needs more than the drafter's "
                             f"{spec.num_lookahead_tokens} lookahead slots"))
        if (spec is not None and self.rules.spec_v2_rules
                and spec.num_speculative_tokens_per_batch_size is None):
            # 0.33.0 pads a decode admitted from the queue to 1 + k tokens ("Pad new decode
            # requests to uniform spec decoding size") and never schedules it un-padded: a
            # budget below that leaves it queued for ever; a threshold below it fails the
            # scheduler's `assert num_new_tokens == 1 + self.num_spec_tokens`.
            width = 1 + spec.num_speculative_tokens
            slots = spec.num_draft_slots  # (a draft model's: one of the budget per request)
            if spec.num_lookahead_tokens < budget < width + slots:  # (else refused above)
                problems.append(("max_num_batched_tokens", budget,
                                 f"vLLM {self.engine_version} pads a decode it admits to 1 + k "
                                 f"= {width} tokens" + (f" beside its draft model's {slots} "
                                                        "slot" if slots else "")
                                 + " and would never schedule one here"))
            if threshold and threshold < width:
                problems.append(("long_prefill_token_threshold", threshold,
                                 f"vLLM {self.engine_version} pads a decode it admits to 1 + k "
                                 f"= {width} tokens, which a smaller threshold fails (an "
                                 "assertion in its scheduler)"))
        if (spec is not None and spec.num_speculative_tokens_per_batch_size is not None
                and not self.rules.spec_v2_rules):
            problems.append(("speculative.num_speculative_tokens_per_batch_size",
                             spec.num_speculative_tokens_per_batch_size,
                             f"dynamic speculative decoding came after vLLM "
                             f"{self.engine_version}: set engine_version: 0.33.0"))
        if self.speculative is not None and self.min_chunk_tokens is not None:
            problems.append(("min_chunk_tokens", self.min_chunk_tokens,
                             "not modelled with speculative decoding (vLLM has no such "
                             "setting)"))
        if problems:
            raise invalid(*problems)
        return self


def _dynamic_schedule_problem(schedule: list[list[int]]) -> str | None:
    """What vLLM's `validate_and_normalize_dynamic_sd_schedule` refuses in a schedule."""
    if not schedule:
        return "give at least one [first, last, k] range"
    if any(len(entry) != 3 for entry in schedule):
        return "each entry is [first, last, k]: a range of batch sizes and its drafts"
    for first, end, drafts in schedule:
        if first <= 0 or end <= 0:
            return f"batch-size range ({first}, {end}) must be positive"
        if first > end:
            return f"range start must be <= end: ({first}, {end}, {drafts})"
        if drafts < 0:
            return f"drafts must be >= 0: ({first}, {end}, {drafts})"
    ordered = sorted(schedule)
    if any(b[0] <= a[1] for a, b in zip(ordered, ordered[1:], strict=False)):
        return "batch-size ranges must not overlap"
    if ordered[0][0] != 1:
        return "the first range must start at 1, so that every batch size has its k"
    return None


def unchunked_reason(chunking: bool, budget: int, num_kv_tokens: int, num_draft_slots: int = 0
                     ) -> str | None:
    """Rule 6: without chunking a prefill, or a recompute after preemption, is one iteration:
    a request needing more than the budget (less a draft model's slot for it) never runs."""
    if chunking or num_kv_tokens <= budget - num_draft_slots:
        return None
    slots = f" less its draft model's {num_draft_slots} slot(s)" if num_draft_slots else ""
    return (f"max_num_batched_tokens: needs {num_kv_tokens} tokens in one prefill, "
            f"max_num_batched_tokens is {budget}{slots} and chunked prefill is off")
