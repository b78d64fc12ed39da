"""Speculative decoding's figures, as vLLM's benchmark reports them (`vllm bench serve`:
`spec_decode_*`, from the engine's `SpecDecodingStats` counters)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sim.core.speculative import Acceptance


def speculative_stats(acceptances: Sequence[Acceptance]) -> dict[str, Any]:
    """Verifications (`num_drafts`), draft tokens verified and accepted over every replica;
    the acceptance rate (%, accepted / drafted), the acceptance length (1 + accepted per
    verification: tokens a decode step yields) and each position's acceptance rate (accepted
    there per verification), as vLLM computes them; beside the rates drawn from."""
    num_drafts = sum(a.num_drafts for a in acceptances)
    draft_tokens = sum(a.num_draft_tokens for a in acceptances)
    accepted = sum(a.num_accepted_tokens for a in acceptances)
    per_pos = [sum(col) for col in zip(*(a.num_accepted_per_pos for a in acceptances),
                                        strict=True)]
    first = acceptances[0]
    return {
        "num_speculative_tokens": first.num_speculative_tokens,
        "conditional_rates": list(first.rates),
        "expected_acceptance_length": 1 + first.mean_accepted(),
        "num_drafts": num_drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": 100 * accepted / draft_tokens if draft_tokens else None,
        "acceptance_length": 1 + accepted / num_drafts if num_drafts else None,
        "per_position_acceptance_rates": [n / num_drafts if num_drafts else 0.0
                                          for n in per_pos],
    }
