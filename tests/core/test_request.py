"""A request as token counters (`sim.core.request`): no prefill or decode phase, only known
tokens (prompt plus what was sampled) of which some are computed; a decode is a catch-up of one
token, and the last sampled token is never computed."""

from __future__ import annotations

import itertools

from sim.core.request import Request, Status
from tests.helpers import make_request


def test_a_new_request_waits_with_its_whole_prompt_to_compute():
    req = Request(7, 1.5, 100, 20)
    assert (req.status, req.num_tokens, req.num_uncomputed_tokens) == (Status.WAITING, 100, 100)
    assert not req.is_decoding and not req.is_caught_up
    assert req.num_remaining_output_tokens == 20
    assert req.num_max_kv_tokens == 119  # the 20th output token is sampled, never computed


def test_a_decode_is_a_catch_up_of_one_token():
    """After the prompt's last chunk samples the first token, each iteration computes that token
    and samples the next: one uncomputed token, every time."""
    req = make_request(0, prompt=30, output=4)
    req.num_computed_tokens = 29  # one prompt token short: still a prefill, never sampled
    assert req.num_uncomputed_tokens == 1 and not req.is_decoding
    req.num_computed_tokens, req.num_output_tokens = 30, 1  # the first token sampled
    for generated in range(1, 4):
        assert req.is_decoding and req.num_uncomputed_tokens == 1
        assert req.num_remaining_output_tokens == 4 - generated
        req.num_computed_tokens += 1
        req.num_output_tokens += 1
    assert req.num_computed_tokens == req.num_max_kv_tokens == 33  # all but the last token


def test_is_decoding_and_is_caught_up_by_their_definitions():
    """On every count of a short request: decoding is having sampled and being one token short
    of everything known; caught up is having everything known computed (a pipeline's token in
    flight); never both, and a prompt one token short is neither."""
    for output, computed in itertools.product(range(4), range(0, 14)):
        req = make_request(0, prompt=10, output=5)
        req.num_output_tokens, req.num_computed_tokens = output, computed
        if computed > req.num_tokens:
            continue
        assert req.is_decoding == (output > 0 and req.num_uncomputed_tokens == 1)
        assert req.is_caught_up == (req.num_uncomputed_tokens == 0)
        assert not (req.is_decoding and req.is_caught_up)


def test_make_request_builds_a_request_part_way_through_its_output():
    req = make_request(3, prompt=50, output=10, arrival_s=2.0, generated=4)
    assert (req.request_id, req.arrival_s, req.num_output_tokens) == (3, 2.0, 4)
    assert req.num_computed_tokens == 53 and req.is_decoding
