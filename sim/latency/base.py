"""The latency-model interface: how long one iteration of a given shape takes.

A model sees only the shape of a batch, a handful of sums over its requests, so the profiler's
fitted models, the roofline and the test constant all plug in the same way. Fields of a
`BatchShape` may be numpy arrays, one entry per iteration: the engine predicts a whole stretch of
decode-only iterations with one vectorised call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sim.core.plan import Plan
from sim.core.registry import Registry
from sim.core.request import Request
from sim.hardware.gpus import GPUSpec
from sim.hardware.models import ModelShape
from sim.hardware.parallelism import SINGLE_GPU, Parallelism
from sim.latency.noise import NoiseConfig

if TYPE_CHECKING:
    from sim.core.state import ReplicaState

Num = Any  # float, int, or a numpy array of one value per iteration


@dataclass(slots=True)
class BatchShape:
    """What an iteration computes, summed over its requests."""

    num_prefill_tokens: Num = 0  # tokens of prefill chunks
    num_prefill_seqs: Num = 0  # requests with a prefill chunk
    num_decode_tokens: Num = 0  # requests decoding (one token each)
    num_sampled_tokens: Num = 0  # rows through the LM head: decodes plus final chunks
    # Query-key pairs of prefill attention: a chunk of q tokens after p cached ones has
    # q*p + q*(q+1)/2 of them (causal).
    prefill_attn_pairs: Num = 0
    prefill_kv_tokens: Num = 0  # KV tokens each chunk's attention reads: p + q per chunk
    decode_kv_tokens: Num = 0  # KV tokens decode attention reads: context + 1 per decode
    # Speculative decoding: draft tokens the decodes verify (each a query row beside its
    # decode's, through the linear layers and the LM head, reading the same KV), and the
    # requests a drafter proposes for after this iteration.
    num_spec_tokens: Num = 0
    num_drafting_seqs: Num = 0

    @property
    def num_tokens(self) -> Num:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_spec_tokens

    @classmethod
    def from_plan(cls, plan: Plan, requests: Mapping[int, Request]) -> BatchShape:
        """The shape of `plan`, whose requests `requests` holds as they are before it runs."""
        num_decodes = decode_kv = num_spec = 0
        prefill = []
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            req = requests[request_id]
            if req.is_decoding:
                num_decodes += 1
                decode_kv += req.num_tokens  # its context, and the token it computes
                num_spec += num_tokens - 1  # drafts verified beside it
            else:
                prefill.append((req, num_tokens))
        shape = cls._with_chunks(prefill, num_decodes, decode_kv)
        drafting = plan.num_drafts_proposed or plan.drafter_runs
        if num_spec or drafting:
            shape.num_spec_tokens = num_spec
            shape.num_sampled_tokens += num_spec
            shape.num_drafting_seqs = shape.num_sampled_tokens - num_spec if drafting else 0
        return shape

    @classmethod
    def of_replica(cls, plan: Plan, state: ReplicaState) -> BatchShape:
        """`from_plan` of a plan for `state`'s running requests, as the engine asks it at every
        stepped iteration: where the plan schedules every running request, without a pass
        over the decodes, which are often hundreds. Those with prompt tokens left are
        `state.prefilling()`; every other running request decodes (pipelined too: one waiting
        for a token in flight is not scheduled, so not all would be), and the KV the decodes
        read is the running requests' known tokens (a placeholder's counted as known), which
        the state counts as they move, less the prefilling ones'."""
        num_seqs = plan.num_seqs
        if (num_seqs != len(state.running) or state.acceptance is not None
                or plan.num_drafts_proposed or plan.drafter_runs):
            # Some are not scheduled (a budget spent, prompts first: a plan of a few; a token
            # in flight), or a drafter runs after it: each of the plan's requests asked.
            return cls.from_plan(plan, state.requests)
        prefilling = state.prefilling()
        if not prefilling:
            return cls.decode_only(num_seqs, state.num_running_tokens)
        scheduled = plan.num_scheduled_tokens
        decode_kv = state.num_running_tokens
        prefill = []
        for req in prefilling:
            decode_kv -= req.num_tokens
            prefill.append((req, scheduled[req.request_id]))
        return cls._with_chunks(prefill, num_seqs - len(prefilling), decode_kv)

    @classmethod
    def _with_chunks(cls, prefill: list[tuple[Request, int]], num_decodes: int,
                     decode_kv: int) -> BatchShape:
        """The shape of `num_decodes` decodes reading `decode_kv` KV tokens beside the chunks
        `prefill` (each request and its tokens now)."""
        prefill_tokens = attn_pairs = prefill_kv = num_final_chunks = 0
        for req, num_tokens in prefill:
            cached = req.num_computed_tokens
            prefill_tokens += num_tokens
            attn_pairs += num_tokens * cached + num_tokens * (num_tokens + 1) // 2
            prefill_kv += cached + num_tokens
            if cached + num_tokens == req.num_tokens:
                num_final_chunks += 1
        return cls(prefill_tokens, len(prefill), num_decodes, num_decodes + num_final_chunks,
                   attn_pairs, prefill_kv, decode_kv)

    @classmethod
    def decode_only(cls, num_seqs: int, decode_kv_tokens: Num) -> BatchShape:
        return cls(num_decode_tokens=num_seqs, num_sampled_tokens=num_seqs,
                   decode_kv_tokens=decode_kv_tokens)

    def prompts_only(self) -> BatchShape:
        """Its prompt chunks alone, nothing sampled (a drafter's pass over them)."""
        return BatchShape(num_prefill_tokens=self.num_prefill_tokens,
                          num_prefill_seqs=self.num_prefill_seqs,
                          prefill_attn_pairs=self.prefill_attn_pairs,
                          prefill_kv_tokens=self.prefill_kv_tokens)


class LatencyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    noise: NoiseConfig = Field(default_factory=NoiseConfig,
                               description="per-iteration jitter (sim.latency.noise)")
    scale: float = Field(1.0, gt=0, le=100,
                         description="multiply every predicted iteration time: a "
                                     "sensitivity, or an end of the model's error band "
                                     "(servesim plan checks its answer at both)")


class LatencyModel(ABC):
    """Predicts the duration of an iteration from its shape."""

    Config: ClassVar[type[LatencyConfig]] = LatencyConfig
    # True if predictions depend on the order of calls (e.g. durations replayed one by one from
    # a recording): the engine then steps every iteration instead of fast-forwarding stretches.
    sequential: ClassVar[bool] = False
    # False for measured durations (a recording), which already carry their jitter.
    accepts_noise: ClassVar[bool] = True

    @abstractmethod
    def __init__(self, config: Any, model: ModelShape, gpu: GPUSpec,
                 parallelism: Parallelism = SINGLE_GPU) -> None:
        """Build from the validated config and the replica's model, GPU and split over GPUs
        (a model that cannot predict a split raises an InputError saying so)."""

    @abstractmethod
    def iteration_time_s(self, shape: BatchShape) -> Num:
        """Seconds for one iteration; element-wise if the shape's fields are arrays, giving for
        each entry exactly (bit for bit) what a call with that entry alone gives: the engine
        predicts a stretch of decode iterations with one call."""

    def host_time_s(self, shape: BatchShape) -> Num:
        """The part of `iteration_time_s` that is the engine's host work (scheduling, input
        preparation, output processing) rather than the GPU's: an engine that overlaps it with
        the GPU's previous iteration (vLLM's async scheduling, SGLang's overlap loop) takes the
        larger of the two (`PipelinedReplica`). None of it by default."""
        return 0.0

    def lockstep_time_s(self, shapes: Sequence[BatchShape], num_tokens: Sequence[int]
                        ) -> tuple[float, float]:
        """Seconds of one step of data-parallel ranks run in lockstep (`shapes`, one each,
        each run at `num_tokens`: its own tokens, or the most of any rank's where the engine
        pads them alike), and of those the all-to-all's per MoE layer. By default the
        slowest rank's own time sets the pace, with no collective between ranks."""
        return max(float(self.iteration_time_s(shape)) for shape in shapes), 0.0

    def describe(self) -> dict[str, Any]:
        """Facts for the run summary (e.g. extrapolation warnings)."""
        return {}

    def noise_quantiles(self) -> dict[str, np.ndarray] | None:
        """Measured/predicted ratios by regime ("decode", "mixed", "prefill"), as quantile
        functions of mean 1 on an even grid, for `noise: {kind: empirical}`; None where the
        model carries no measurements."""
        return None


LATENCY_MODELS: Registry[type[LatencyModel]] = Registry("latency model", "sim.latency",
                                                       "LATENCY_MODELS")


class TokenTable:
    """f(n) for integer n >= 0 (tokens in a batch, say), tabulated on first use by blocks of
    `block` entries, so a prediction is a look-up: a plain float for a scalar, an array for an
    array, the same values either way (an entry never depends on which call computed it,
    since blocks always cover the same ranges). `f` maps a float64 array of n to seconds."""

    def __init__(self, f: Callable[[np.ndarray], np.ndarray], block: int = 4096) -> None:
        self.f = f
        self.block = block
        self.values: list[float] = []
        self.array = np.zeros(0)

    def grow(self, n: int) -> None:
        """Tabulate up to and including n, whole blocks at a time."""
        blocks = []
        size = len(self.values)
        while size <= n:
            blocks.append(self.f(np.arange(size, size + self.block, dtype=np.float64)))
            size += self.block
        if blocks:
            self.array = np.concatenate([self.array, *blocks])
            for block in blocks:
                self.values.extend(block.tolist())

    def __call__(self, n: Num) -> Num:
        if type(n) is int and n < len(self.values):  # a stepped iteration's look-up
            return self.values[n]
        if isinstance(n, np.ndarray):
            index = n.astype(np.intp, copy=False)
            try:  # counts are never negative: only past the end can an index miss
                return self.array[index]
            except IndexError:  # beyond the table: grow it (rare, so not checked first)
                self.grow(int(index.max()))
                return self.array[index]
        n = int(n)
        if n >= len(self.values):
            self.grow(n)
        return self.values[n]


def maximum(a: Num, b: Num) -> Num:
    """max() that also works element-wise on arrays (and stays a plain float on floats)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a >= b else b


class ScaledLatency:
    """A latency model whose iteration times (and their host part) are `scale` times another's;
    everything else is the other's. Element-wise as the model is, so a stretch and its steps
    still agree bit for bit."""

    def __init__(self, model: LatencyModel, scale: float) -> None:
        self._model = model
        self._scale = scale

    def iteration_time_s(self, shape: BatchShape) -> Num:
        return self._model.iteration_time_s(shape) * self._scale

    def host_time_s(self, shape: BatchShape) -> Num:
        return self._model.host_time_s(shape) * self._scale

    def lockstep_time_s(self, shapes: Sequence[BatchShape], num_tokens: Sequence[int]
                        ) -> tuple[float, float]:
        step_s, all_to_all_s = self._model.lockstep_time_s(shapes, num_tokens)
        return step_s * self._scale, all_to_all_s * self._scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class DraftingLatency:
    """A latency model with speculative decoding's drafter added: after an iteration, a
    drafter runs `num_speculative_tokens` passes over the requests that sampled, each pass
    taking `ratio` times what the target takes for a decode step of those requests (the
    drafter's share of the weights read: an EAGLE head is one decoder layer and an LM head);
    and it runs over the iteration's prompt tokens too (its own KV for them: EAGLE's first
    pass, a draft model's prefill), `prompt_ratio` (default `ratio`) times the target's time
    for them alone. With vLLM's dynamic schedule (`passes_by_batch_size`, entry n for a step
    of n requests) the passes are the step's, at least one: with k = 0 the drafter still
    runs its first pass, to keep its KV (`propose`). Everything else is the other model's."""

    def __init__(self, model: LatencyModel, ratio: float, num_speculative_tokens: int,
                 prompt_ratio: float | None = None,
                 passes_by_batch_size: Sequence[int] | None = None) -> None:
        self._model = model
        self._per_pass = ratio
        self._prompt_ratio = ratio if prompt_ratio is None else prompt_ratio
        self._num_passes = num_speculative_tokens
        self._passes_by_batch = (None if passes_by_batch_size is None
                                 else np.maximum(np.asarray(passes_by_batch_size,
                                                            dtype=np.int64), 1))

    def iteration_time_s(self, shape: BatchShape) -> Num:
        time = self._model.iteration_time_s(shape)
        if np.any(shape.num_prefill_tokens):
            prompts = shape.prompts_only()
            time = time + self._prompt_ratio * self._model.iteration_time_s(prompts)
        num_seqs = shape.num_drafting_seqs
        if not np.any(num_seqs):
            return time
        # A decode step of those requests reading the decodes' KV (the drafter's own KV is
        # smaller still: within its share of the step).
        step = self._model.iteration_time_s(
            BatchShape.decode_only(num_seqs, shape.decode_kv_tokens))
        passes: Num = self._num_passes
        if self._passes_by_batch is not None:  # (the step's requests: chunks and decodes)
            passes = self._passes_by_batch[shape.num_prefill_seqs + shape.num_decode_tokens]
            if not isinstance(passes, np.ndarray) or passes.ndim == 0:
                passes = int(passes)
        return time + (passes * self._per_pass) * step

    def lockstep_time_s(self, shapes: Sequence[BatchShape], num_tokens: Sequence[int]
                        ) -> tuple[float, float]:
        """The target's lockstep step, then the drafter's passes in lockstep as well (vLLM's
        proposer pads each across data-parallel ranks, and a rank without work runs its dummy
        pass): over the ranks' prompt tokens, padded as the step was, then the passes over
        each rank's sampled requests, always padded to the most of any rank's (at most
        `max_num_seqs`: within the graphs). The all-to-all returned is the target's per MoE
        layer."""
        model = self._model
        step_s, all_to_all_s = model.lockstep_time_s(shapes, num_tokens)
        # (Padded: every rank at the most of any's; with equal counts it makes no difference
        # to the target, and the prompts are padded alike.)
        padded = len(set(num_tokens)) == 1
        prompts = [int(shape.num_prefill_tokens) for shape in shapes]
        if any(prompts) and self._prompt_ratio:
            prompt_shapes = [shape.prompts_only() for shape in shapes]
            counts = [max(prompts)] * len(prompts) if padded else prompts
            step_s += self._prompt_ratio * model.lockstep_time_s(prompt_shapes, counts)[0]
        drafting = [int(shape.num_drafting_seqs) for shape in shapes]
        if any(drafting) and self._per_pass:
            draft_shapes = [BatchShape.decode_only(n, shape.decode_kv_tokens if n else 0)
                            for shape, n in zip(shapes, drafting, strict=True)]
            pass_s = model.lockstep_time_s(draft_shapes, [max(drafting)] * len(drafting))[0]
            step_s += (self._num_passes * self._per_pass) * pass_s
        return step_s, all_to_all_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class EagleDraftingLatency:
    """A latency model with SGLang's EAGLE worker added (`eagle_worker_v2.py`), each pass
    `ratio` times what the target takes for the same tokens: in a step with decodes,
    `num_steps` - 1 draft passes of `topk` tokens per decode (the first level's come from the
    last extend) and a draft extend over each decode's verified tokens (its whole width, only
    the last row sampled); in a step with prompt chunks, a draft extend over their tokens,
    `prompt_ratio` (default `ratio`) times the target's. Everything else is the other
    model's."""

    def __init__(self, model: LatencyModel, ratio: float, num_steps: int | None,
                 topk: int | None, prompt_ratio: float | None = None) -> None:
        assert num_steps is not None and topk is not None
        self._model = model
        self._ratio = ratio
        self._prompt_ratio = ratio if prompt_ratio is None else prompt_ratio
        self._num_steps = num_steps
        self._topk = topk

    def iteration_time_s(self, shape: BatchShape) -> Num:
        model = self._model
        time = model.iteration_time_s(shape)
        if np.any(shape.num_prefill_tokens):
            prompts = shape.prompts_only()
            # (Element-wise: an iteration without prompt tokens adds nothing.)
            time = time + self._prompt_ratio * model.iteration_time_s(prompts) * (
                shape.num_prefill_tokens > 0)
        num_decodes = shape.num_decode_tokens
        if not np.any(num_decodes):
            return time
        extend = model.iteration_time_s(self._draft_extend(shape))
        drafts = (self._num_steps - 1) * model.iteration_time_s(
            self._draft_pass(shape)) if self._num_steps > 1 else 0
        return time + self._ratio * (extend + drafts) * (num_decodes > 0)

    @staticmethod
    def _draft_extend(shape: BatchShape) -> BatchShape:
        """The draft extend over a step's decodes' verified tokens (the last row sampled)."""
        return BatchShape(num_decode_tokens=shape.num_decode_tokens,
                          num_sampled_tokens=shape.num_decode_tokens,
                          decode_kv_tokens=shape.decode_kv_tokens,
                          num_spec_tokens=shape.num_spec_tokens)

    def _draft_pass(self, shape: BatchShape) -> BatchShape:
        """One draft pass of `topk` tokens per decode of a step."""
        return BatchShape.decode_only(shape.num_decode_tokens * self._topk,
                                      shape.decode_kv_tokens)

    def lockstep_time_s(self, shapes: Sequence[BatchShape], num_tokens: Sequence[int]
                        ) -> tuple[float, float]:
        """The target's lockstep step, then the drafter's passes in lockstep too (SGLang's
        DP attention syncs the draft's forwards alike: a rank without requests runs idle
        ones), each pass at the ranks' own tokens, or at the most of any rank's where the
        step was padded. The all-to-all returned is the target's per MoE layer."""
        model = self._model
        step_s, all_to_all_s = model.lockstep_time_s(shapes, num_tokens)
        padded = len(set(num_tokens)) == 1

        def together(passes: list[BatchShape]) -> float:
            own = [int(shape.num_tokens) for shape in passes]
            return model.lockstep_time_s(passes, [max(own)] * len(own) if padded else own)[0]

        if self._prompt_ratio and any(shape.num_prefill_tokens for shape in shapes):
            step_s += self._prompt_ratio * together([shape.prompts_only() for shape in shapes])
        if self._ratio and any(shape.num_decode_tokens for shape in shapes):
            extend = together([self._draft_extend(shape) for shape in shapes])
            drafts = (self._num_steps - 1) * together(
                [self._draft_pass(shape) for shape in shapes]) if self._num_steps > 1 else 0.0
            step_s += self._ratio * (extend + drafts)
        return step_s, all_to_all_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def drafter_time_ratio(method: str, model: ModelShape) -> float:
    """A drafter's pass relative to the target's decode step, by the weights each reads: 0 for
    n-gram prompt lookup (host-side); for EAGLE, EAGLE-3 and an MTP head, one decoder layer of
    the target's shape and an LM head (vLLM's EAGLE heads share the target's embedding)."""
    if method == "ngram":
        return 0.0
    head = model.vocab_size * model.hidden_size
    return (_drafter_layer_params(model) + head) / model.num_active_params


def drafter_prompt_ratio(method: str, model: ModelShape) -> float:
    """The drafter's pass over prompt tokens relative to the target's, by the compute each
    does per token: one decoder layer against all of the target's (an LM head runs on the
    sampled rows only, in both: next to nothing over a prompt). 0 for n-gram."""
    if method == "ngram":
        return 0.0
    return _drafter_layer_params(model) / (model.num_active_params - model.embedding_params)


def _drafter_layer_params(model: ModelShape) -> int:
    """One decoder layer of the target's shape, its active parameters (a dense layer where the
    target has any, else the experts a token reaches)."""
    return model.attn_params_per_layer + (
        model.dense_mlp_params_per_layer if not model.is_moe or model.num_dense_layers
        else model.num_experts_per_token * model.expert_params + model.shared_expert_params)
