"""Speculative decoding's outcome per verification: how many of a request's draft tokens the
target model accepts.

A decode that verifies k drafts computes 1 + k tokens and samples a + 1 of them, a <= k being
the drafts accepted in a row (vLLM's rejection sampler stops at the first rejection and adds the
target's own token). Acceptance is data-dependent; here it is drawn from per-position rates:
`rates[i]` is the chance that draft i + 1 is accepted given that the drafts before it were
(one rate for all positions is the usual geometric model; vLLM's `--speculative-config` metrics
print the unconditional per-position rates, `accepted_rate_of_position`). Each draw is a pure
function of (seed, request, its output length before the step), so a request's acceptance
does not depend on which other requests share its batch, and an engine recorder can draw the
same (`tools/golden/record_vllm.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

_MASK = (1 << 64) - 1
_MATCH = 0x6E6772616D << 24  # salts the match draw apart from the acceptance draw


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Acceptance:
    """Draws how many drafts a verification accepts, from conditional per-position rates."""

    def __init__(self, rates: Sequence[float], seed: int, match_rate: float = 1.0) -> None:
        assert rates and all(0.0 <= r <= 1.0 for r in rates) and 0.0 < match_rate <= 1.0
        # at_least[i]: the chance that at least i + 1 drafts are accepted, times 2**64 (so a
        # draw compares integers).
        self.rates = tuple(float(r) for r in rates)
        at_least, p = [], 1.0
        for r in self.rates:
            p *= r
            at_least.append(int(p * 2.0**64))
        self._at_least = at_least
        self._seed = _mix(seed & _MASK)
        # n-gram prompt lookup: the chance a step's lookup finds a match, times 2**64 (None:
        # every step proposes).
        self._match = None if match_rate >= 1.0 else int(match_rate * 2.0**64)
        # What vLLM's spec-decode metrics count (`SpecDecodingStats`): verifications with
        # drafts, draft tokens verified, accepted, and accepted at each position.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * len(self.rates)

    @property
    def num_speculative_tokens(self) -> int:
        return len(self.rates)

    def accepted(self, request_id: int, num_output_tokens: int, num_drafts: int) -> int:
        """Drafts accepted when request `request_id`, having sampled `num_output_tokens`, has
        `num_drafts` drafts verified."""
        u = _mix(self._seed ^ _mix((request_id << 32) ^ num_output_tokens))
        at_least = self._at_least
        a = 0
        while a < num_drafts and u < at_least[a]:
            a += 1
        return a

    def matched(self, request_id: int, num_output_tokens: int) -> bool:
        """Whether the drafter proposes drafts for request `request_id` once it has sampled
        `num_output_tokens` (n-gram lookup may find no match; a drafter model always
        proposes). A draw of its own, a pure function of the same three."""
        if self._match is None:
            return True
        return _mix(self._seed ^ _mix((request_id << 32) ^ num_output_tokens ^ _MATCH)) \
            < self._match

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Count a verification of `num_drafts` drafts of which `num_accepted` were accepted
        (padding included, as vLLM counts it)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1

    def mean_accepted(self) -> float:
        """Expected drafts accepted per verification of all `num_speculative_tokens`."""
        return sum(self._at_least) / 2.0**64


def conditional_rates(per_position: Sequence[float]) -> list[float]:
    """Conditional rates from vLLM's unconditional per-position acceptance rates (the chance
    that draft i is accepted, which requires every draft before it: non-increasing)."""
    rates, before = [], 1.0
    for p in per_position:
        rates.append(0.0 if before == 0 else min(1.0, p / before))
        before = p
    return rates
