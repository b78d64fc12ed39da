"""`servesim list --params`: defaults read as quantities."""

from __future__ import annotations

from sim.cli.listing import parameter_rows, singular
from sim.schedulers import SCHEDULERS


def test_a_default_of_one_is_in_the_singular_and_symbols_stay_as_they_are():
    assert [singular(u) for u in ("requests", "tokens", "s", "ms", "GB/s")] == [
        "request", "token", "s", "ms", "GB/s"]
    rows = parameter_rows(SCHEDULERS.get("chunked_prefill").Config)
    assert rows["max_num_partial_prefills"][0] == "1 request"
    assert rows["max_num_seqs"][0] == "256 requests"


def test_a_default_the_engine_derives_says_from_what():
    """SGLang derives its running limit from the KV pool and its chunk from the GPU: the
    listing says so, not the placeholder a field needs."""
    rows = parameter_rows(SCHEDULERS.get("sglang").Config)
    assert rows["max_num_seqs"][0] == "from the KV pool"
    assert rows["chunked_prefill_size"][0] == "by the GPU"
