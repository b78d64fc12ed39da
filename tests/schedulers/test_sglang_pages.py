"""SGLang's pages (`--page-size`, servesim's KV block) in the `sglang` policy, worked by hand:
admission counts each extend in whole pages and keeps a page spare a request, and with the radix
cache a paged allocation evicts for a page per request of its batch before it allocates. The
golden schedules `tests/golden/sglang-0.5.23/page*` check the same rules step for step."""

from __future__ import annotations

import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.core.request import Request
from sim.schedulers.sglang import SGLang, SGLangConfig
from tests.helpers import Stepper, cached_state, hashed, make_request, make_state, serve


def sglang(**params) -> SGLang:
    return SGLang(SGLangConfig(name="sglang", overlap_schedule=False, **params))


def test_a_prefill_budget_counts_each_extend_in_whole_pages():
    """Chunks of 64 tokens: two prompts of 10 take a page of 16 each from the budget
    (`_update_prefill_budget`), so the third prompt's chunk is 32 tokens, not 44."""
    for page, chunk in ((16, 32), (1, 44)):
        reqs = (make_request(0, prompt=10, output=4), make_request(1, prompt=10, output=4),
                make_request(2, prompt=50, output=4))
        state = make_state(num_blocks=1600 // page, block_size=page, waiting=reqs)
        plan = Stepper(sglang(chunked_prefill_size=64), state).step()
        assert plan.num_scheduled_tokens == {0: 10, 1: 10, 2: chunk}, page


def test_with_the_radix_cache_admission_counts_the_extend_unrounded():
    """`add_one_req`'s total: extend + outputs + a page must be below the free tokens. A pool of
    5 pages of 4 (20 tokens) admits a prompt of 10 with 5 outputs: 10 + 5 + 4 = 19 < 20 (the
    extend in pages, 12, would not pass)."""
    state = cached_state(num_blocks=5, block_size=4, eviction="lru_leaf")
    state.add(hashed(0, 10, 5, (1, 2), unit=4))
    assert Stepper(sglang(), state).step().num_scheduled_tokens == {0: 10}


def cached_prefix(num_blocks: int) -> tuple:
    """A radix cache of `num_blocks` pages of 4 holding an unused prompt of 4 pages, and a
    request that would hit all of it but its last page."""
    state = cached_state(num_blocks=num_blocks, block_size=4, eviction="lru_leaf")
    serve(state, hashed(0, 16, 1, (1, 2, 3, 4), unit=4))
    assert state.kv.num_cached_blocks == 4
    return state, hashed(9, 17, 1, (1, 2, 3, 4), unit=4)


def test_a_paged_prefill_evicts_for_a_page_more_per_request():
    """One page holds nothing: a prompt of 4 needs only that page, but SGLang's paged
    allocator first evicts until its tokens plus a page (8) are free
    (`alloc_paged_token_slots_extend`): the cached prompt goes."""
    state, probe = cached_prefix(5)
    state.add(Request(1, 0.0, 4, 4))
    assert Stepper(sglang(), state).step().num_scheduled_tokens == {1: 4}
    assert state.kv.num_cached_blocks == 0
    assert state.kv.prefix_hit_tokens(probe) == 0


def test_a_paged_decode_evicts_for_a_page_per_request():
    """A decode whose next token fits the page it holds takes no page, but SGLang's paged
    decode first evicts until a page per request of the batch is free
    (`alloc_paged_token_slots_decode`): with none free the cached prompt goes. With pages of
    one token a decode evicts only the token it takes."""
    state, probe = cached_prefix(6)
    running = make_request(1, prompt=5, output=4, generated=1)  # 5 tokens: 2 pages, room
    state.add(running)
    assert state.kv.try_allocate(running, 0)
    state.admit(running)
    assert state.kv.num_free_blocks - state.kv.num_cached_blocks == 0
    assert Stepper(sglang(), state).step().num_scheduled_tokens == {1: 1}
    assert state.kv.num_held_blocks(1) == 2
    assert state.kv.num_cached_blocks == 0 and state.kv.prefix_hit_tokens(probe) == 0


def scenario(block_size: int, **scheduler) -> dict:
    return {"workload": {"format": "synthetic", "num_requests": 4,
                         "arrivals": {"process": "poisson", "qps": 1.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": 64},
                                     "output": {"dist": "fixed", "value": 8}}},
            "replica": {"scheduler": {"name": "sglang", **scheduler},
                        "latency": {"kind": "constant", "iteration_s": 0.01},
                        "kv_cache": {"block_size": block_size, "num_blocks": 400}}}


@pytest.mark.parametrize(("scheduler", "named"), [
    ({"speculative": {"algorithm": "eagle", "num_steps": 3, "eagle_topk": 1,
                      "num_draft_tokens": 4, "acceptance_rate": 0.7}},
     "replica.kv_cache.block_size=16"),
    ({"hierarchical_cache": {}}, "replica.kv_cache.block_size=16"),
    ({"mixed_chunk": True}, "replica.kv_cache.block_size=16"),
    ({"chunked_prefill_size": 1000}, "replica.scheduler.chunked_prefill_size=1000"),
])
def test_what_pages_are_not_modelled_with_is_refused(scheduler, named):
    """Speculative decoding, the hierarchical cache and mixed chunks on pages of more than one
    token are not checked against SGLang: refused, naming the block size; a chunk size that is
    not whole pages SGLang refuses itself. On pages of one token each runs."""
    with pytest.raises(InputError) as refused:
        parse_scenario(scenario(16, **scheduler), "t")
    assert named in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1
    parse_scenario(scenario(1, **scheduler), "t")
