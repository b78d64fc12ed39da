"""Speculative steps sent ahead (`sim.core.spec_commit`, vLLM's async scheduling): a step's
drafts that are padding (0.33.0 pads a decode admitted from the queue) are known from the step
itself, not from the request, whose flag the next plan may set again while the step is in
flight; such drafts are never accepted, even at an acceptance rate of 1."""

from __future__ import annotations

from sim.core.plan import Plan
from sim.core.spec_commit import complete_speculative, start_speculative
from sim.core.speculative import Acceptance
from tests.helpers import make_request, make_state


def _decoding_state():
    req = make_request(0, 20, 50, generated=5)  # 24 computed, its 25th token to compute
    state = make_state(running=(req,))
    state.acceptance = Acceptance([1.0] * 3, seed=0)
    return state, req


def test_a_padded_step_accepts_no_draft_and_leaves_the_flag_to_the_next_plan():
    state, req = _decoding_state()
    req.spec_padded = True  # (its plan padded it: 1 token and 3 drafts that cannot be accepted)
    padded = start_speculative(state, Plan({0: 4}), 0.0)
    assert padded[0][3] == -4 and not req.spec_padded  # the entry carries the padding
    req.spec_padded = True  # a later plan pads it again while that step is in flight
    complete_speculative(state, padded, 1.0, stale_delivered=True)
    assert req.spec_padded  # (not consumed by the earlier step)
    assert (req.num_drafts_verified, req.num_drafts_accepted) == (3, 0)
    assert req.num_output_tokens - req.num_placeholders == 6  # one token: its sample


def test_a_step_that_was_not_padded_accepts_its_drafts():
    state, req = _decoding_state()
    step = start_speculative(state, Plan({0: 4}), 0.0)
    assert step[0][3] == 4
    complete_speculative(state, step, 1.0, stale_delivered=True)
    assert (req.num_drafts_verified, req.num_drafts_accepted) == (3, 3)
    assert req.num_output_tokens - req.num_placeholders == 9
