"""Rule 18 of `sim.schedulers.vllm_v1` (speculative decoding) as one vLLM release applies it:
the numbers and switches its scheduler reads, from the `speculative` settings and the release
(`EngineRules.spec_v2_rules`)."""

from __future__ import annotations

from dataclasses import dataclass

from sim.schedulers.vllm_config import VllmV1Config


@dataclass(frozen=True)
class SpecRules:
    num_speculative_tokens: int  # k: drafts proposed after a step that samples
    # KV slots allocated past the tokens scheduled (`num_lookahead_tokens`: k for EAGLE, MTP
    # and draft models), in the running pass and at admission (0.15.1: none there).
    num_lookahead: int
    admission_lookahead: int
    # 0.33.0's input budget: slots a draft model keeps per scheduled request.
    draft_slots: int
    # 0.33.0 (`can_skip_drafts`): no drafting in a step whose drafts no request can use.
    can_skip_drafts: bool
    # 0.33.0: a decode admitted from the queue padded to 1 + k tokens.
    pads_decodes: bool
    # 0.15.1's EAGLE family (`use_eagle`): blocks a prefix hit gives up at its end.
    hit_blocks_dropped: int
    # 0.15.1, synchronous, EAGLE or draft model: drafts for a prompt's unfinished chunk.
    drafts_after_chunk: bool
    # KV slots a request may need past its last token (`capacity_reason`).
    capacity_margin: int
    # 0.33.0 caches a request's blocks after each step (`update_from_output`: computed less
    # in flight), and so does 0.15.1's async scheduler (`AsyncScheduler.
    # _update_request_with_output`); 0.15.1's synchronous one only as it allocates
    # (`sim.core.block_cache`'s `cache_at_free`).
    caches_on_update: bool
    # 0.33.0's dynamic speculative decoding: drafts proposed after a step of n scheduled
    # requests, by n (None: k after every step).
    drafts_by_batch_size: tuple[int, ...] | None

    @classmethod
    def of(cls, config: VllmV1Config) -> SpecRules | None:
        spec = config.speculative
        if spec is None:
            return None
        k, method = spec.num_speculative_tokens, spec.method
        v2 = config.rules.spec_v2_rules
        lookahead = spec.num_lookahead_tokens
        writes_kv = method != "ngram"
        dynamic = spec.drafts_by_batch_size(config.max_num_seqs)
        return cls(
            num_speculative_tokens=k, num_lookahead=lookahead,
            admission_lookahead=lookahead if v2 else 0,
            draft_slots=spec.num_draft_slots if v2 else 0,
            # (No padding with a dynamic schedule: `dynamic_sd_lookup is None`.)
            can_skip_drafts=v2 and lookahead > 0, pads_decodes=v2 and dynamic is None,
            hit_blocks_dropped=int(not v2 and writes_kv and method != "draft_model"),
            drafts_after_chunk=(not v2 and writes_kv and not config.async_scheduling),
            # Its last steps verify k drafts past its last token (async: a step in flight's
            # k more) and allocate the drafter's lookahead beyond them.
            capacity_margin=k * (1 + bool(config.async_scheduling)) + lookahead,
            caches_on_update=v2 or bool(config.async_scheduling),
            drafts_by_batch_size=dynamic)
