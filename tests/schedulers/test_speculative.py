"""Speculative decoding (`vllm_v1`'s `speculative`, rule 18) on a constant step, exactly: a
decode verifies its k drafts in one step of 1 + k tokens and yields the accepted ones plus one;
rejected drafts are computed again; a request's last step stops at its output length; the
drafter's time; the figures vLLM's benchmark reports; and the settings refused. The golden
schedules (`tests/golden/*/spec_*`) check the budgeting against vLLM's own scheduler."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from sim import run_scenario
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.core.speculative import Acceptance, conditional_rates

STEP_S = 0.01


def scenario(spec: dict[str, Any] | None, *, output: int = 9, prompt: int = 10,
             num_requests: int = 1, version: str = "0.15.1", asynchronous: bool = False,
             **scheduler: Any) -> dict[str, Any]:
    sched = {"name": "vllm_v1", "engine_version": version, "async_scheduling": asynchronous,
             **scheduler}
    if spec is not None:
        sched["speculative"] = spec
    return {"name": "spec", "seed": 3,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": 0.01},
                         "lengths": {"prompt": {"dist": "fixed", "value": prompt},
                                     "output": {"dist": "fixed", "value": output}}},
            "replica": {"scheduler": sched,
                        "latency": {"kind": "linear", "base_s": STEP_S, "per_token_s": 0.0},
                        "kv_cache": {"block_size": 4, "num_blocks": 1000},
                        "engine": "none"},
            "record_token_times": True}


def ngram(rate: float, k: int = 3) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "acceptance_rate": rate}


def test_every_draft_accepted_yields_k_plus_one_tokens_a_step():
    # Prompt in one step (first token); then 4 tokens a step: 1 + 4 + 4 = 9 in 3 steps.
    res = run_scenario(parse_scenario(scenario(ngram(1.0)), "t"))
    it, req = res.iterations, res.requests.iloc[0]
    assert it["num_prefill_tokens"].tolist() == [10, 0, 0]
    assert it["num_decode_tokens"].tolist() == [0, 1, 1]
    assert it["num_spec_tokens"].tolist() == [0, 3, 3]
    assert req["num_generated_tokens"] == 9 and req["status"] == "finished"
    assert req["finish_s"] == pytest.approx(3 * STEP_S)
    assert req["tpot_s"] == pytest.approx(2 * STEP_S / 8)  # per token, as vLLM's TPOT
    assert (req["num_drafts_verified"], req["num_drafts_accepted"]) == (6, 6)
    # A row per streamed chunk: the first token, then two chunks of four.
    assert res.tokens["time_s"].tolist() == pytest.approx([0.01, 0.02, 0.03])
    assert res.summary["tbt_s"]["p50"] == pytest.approx(STEP_S)  # gaps between chunks
    spec = res.summary["speculative"]
    assert (spec["num_drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (2, 6, 6)
    assert spec["acceptance_length"] == 4.0 and spec["acceptance_rate"] == 100.0
    assert spec["per_position_acceptance_rates"] == [1.0, 1.0, 1.0]


def test_every_draft_rejected_yields_one_token_a_step_and_computes_the_drafts_again():
    res = run_scenario(parse_scenario(scenario(ngram(0.0)), "t"))
    it, req = res.iterations, res.requests.iloc[0]
    assert len(it) == 9  # the prompt, then 8 steps of one token each
    assert (it["num_spec_tokens"].iloc[1:] == 3).all()
    assert req["num_generated_tokens"] == 9 and req["finish_s"] == pytest.approx(9 * STEP_S)
    # KV of every computed token but the last; the rejected drafts were rolled back.
    assert req["num_computed_tokens"] == 10 + 9 - 1
    spec = res.summary["speculative"]
    assert (spec["num_drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (8, 24, 0)
    assert spec["acceptance_length"] == 1.0


def test_the_last_step_stops_at_the_output_length():
    # 1, then 4 (5), then 4 verified for the 2 left: 7 tokens, the rest trimmed as vLLM does.
    res = run_scenario(parse_scenario(scenario(ngram(1.0), output=7), "t"))
    req = res.requests.iloc[0]
    assert len(res.iterations) == 3
    assert req["num_generated_tokens"] == 7 and req["status"] == "finished"
    assert req["num_drafts_accepted"] == 6  # accepted, though two of them past the end
    # Their KV slots trimmed too, as vLLM trims them: every token's but the last.
    assert req["num_computed_tokens"] == 10 + 7 - 1


def test_drafts_share_the_budget():
    # A budget of 6: the decode's 4 tokens leave 2 for the second request's prompt chunk.
    res = run_scenario(parse_scenario(scenario(
        ngram(1.0), output=9, prompt=4, num_requests=2, max_num_batched_tokens=6,
        max_num_seqs=2), "t"))
    it = res.iterations
    per_step = it["num_prefill_tokens"] + it["num_decode_tokens"] + it["num_spec_tokens"]
    assert (per_step <= 6).all()
    assert res.requests["num_generated_tokens"].tolist() == [9, 9]


def test_acceptance_draws_have_the_rates_asked_for():
    acceptance = Acceptance([0.8, 0.7, 0.5], seed=11)
    draws = np.array([acceptance.accepted(rid, n, 3) for rid in range(200) for n in range(100)])
    expected = [0.8, 0.8 * 0.7, 0.8 * 0.7 * 0.5]  # at least 1, 2, 3 accepted
    for i, p in enumerate(expected, 1):
        assert (draws >= i).mean() == pytest.approx(p, abs=0.01)
    assert draws.mean() == pytest.approx(acceptance.mean_accepted(), abs=0.02)
    # Pure: the same request at the same output length draws the same, whatever else ran.
    assert acceptance.accepted(5, 17, 3) == Acceptance([0.8, 0.7, 0.5], 11).accepted(5, 17, 3)
    assert acceptance.accepted(5, 17, 1) <= 1
    assert conditional_rates([0.8, 0.56, 0.28]) == pytest.approx([0.8, 0.7, 0.5])


def test_a_per_position_rate_gives_vllms_acceptance_length():
    spec = {"method": "eagle3", "num_speculative_tokens": 3,
            "per_position_acceptance": [0.80, 0.56, 0.43], "draft_time_ratio": 0.0}
    res = run_scenario(parse_scenario(scenario(spec, output=400, num_requests=20), "t"))
    stats = res.summary["speculative"]
    assert stats["expected_acceptance_length"] == pytest.approx(2.79)
    assert stats["acceptance_length"] == pytest.approx(2.79, abs=0.05)
    assert stats["per_position_acceptance_rates"] == pytest.approx([0.80, 0.56, 0.43],
                                                                    abs=0.03)


@pytest.mark.parametrize(("version", "last_step_s"), [("0.15.1", 2 * STEP_S),
                                                      ("0.33.0", STEP_S)])
def test_the_drafter_takes_its_passes_after_a_step_that_samples(version, last_step_s):
    # EAGLE, k=2, each pass half a decode step: a step that samples takes 1 + 2 * 0.5 steps,
    # and a half more with a prompt (the drafter's pass over the prompt tokens, half the
    # target's time for them). Two tokens: the prompt's step samples the first, the next
    # step is sure to give the second (one token at least), so no drafts after it can be
    # used: 0.33.0 proposes none then; 0.15.1 always drafts.
    spec = {"method": "eagle", "num_speculative_tokens": 2, "acceptance_rate": 1.0,
            "draft_time_ratio": 0.5}
    res = run_scenario(parse_scenario(scenario(spec, output=2, version=version), "t"))
    durations = res.iterations["duration_s"].tolist()
    assert durations == pytest.approx([2.5 * STEP_S, last_step_s])


def test_async_scheduling_gives_the_same_tokens_and_acceptance():
    spec = {"method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 0.7,
            "draft_time_ratio": 0.0}
    runs = [run_scenario(parse_scenario(scenario(spec, output=60, num_requests=30,
                                                 asynchronous=a), "t")) for a in (False, True)]
    for res in runs:
        assert (res.requests["status"] == "finished").all()
        assert (res.requests["num_generated_tokens"] == 60).all()
        assert res.summary["speculative"]["acceptance_length"] == pytest.approx(
            1 + 0.7 + 0.49 + 0.343, abs=0.1)
    # The draws are the same request by request: each verification at the same output length.
    sync, asynchronous = (r.requests["num_drafts_accepted"] for r in runs)
    assert sync.sum() == pytest.approx(asynchronous.sum(), rel=0.1)


@pytest.mark.parametrize(("version", "asynchronous"), [
    ("0.15.1", False), ("0.33.0", False), ("0.33.0", True)])
def test_an_ngram_lookup_without_a_match_proposes_nothing(version, asynchronous):
    """n-gram drafts every draft accepted, but a lookup finds a match only at some steps (the
    draw `Acceptance.matched`, keyed by the request's output length after the step that
    proposes). Synchronous, a step after a miss computes 1 token and samples 1; scheduled
    ahead (0.33.0 async), it computes 1 + k all the same, its drafts placeholders that turn
    out padding: 1 token sampled, 0 of k accepted. vLLM counts drafts only where some were
    verified, so the acceptance rate is the matched steps'."""
    spec = {**ngram(1.0), "match_rate": 0.5}
    res = run_scenario(parse_scenario(scenario(spec, output=200, version=version,
                                               asynchronous=asynchronous), "t"))
    it = res.iterations
    draws = Acceptance([1.0] * 3, 3, match_rate=0.5)
    # Replay the request's steps from its first token: each sampled 1 + accepted tokens.
    n, expected_spec, expected_out = 1, [], []
    drafts = 3 if draws.matched(0, 1) or asynchronous else 0
    while n < 200:
        verified = min(drafts, 199 - n) if not asynchronous else 3
        accepted = min(verified if (not asynchronous or draws.matched(0, n)) else 0, 199 - n)
        expected_spec.append(verified)
        n += accepted + 1
        expected_out.append(n)
        drafts = 3 if draws.matched(0, n) else 0
    decodes = it.iloc[1:]
    if not asynchronous:
        assert decodes["num_spec_tokens"].tolist() == expected_spec
        assert len(decodes) == len(expected_out)
    misses = sum(not draws.matched(0, m) for m in [1, *expected_out[:-1]])
    assert 0 < misses < len(expected_out)
    req = res.requests.iloc[0]
    assert req["num_generated_tokens"] == 200 and req["status"] == "finished"
    summary = res.summary["speculative"]
    if asynchronous:  # every decode step verified 3 placeholders; misses accepted none
        assert (decodes["num_spec_tokens"] == 3).all()
        # (but a step scheduled ahead past the request's last token: dropped, not counted)
        after = (decodes["start_s"] + decodes["duration_s"] > req["finish_s"] + 1e-12).sum()
        assert after <= 1 and summary["num_drafts"] == len(decodes) - after
        assert summary["acceptance_rate"] < 100.0
    else:  # only steps with drafts count, and each accepted all of them
        assert summary["num_drafts"] == sum(1 for v in expected_spec if v)
        assert summary["acceptance_rate"] == 100.0
    # Fewer tokens a step than when every lookup matches.
    always = run_scenario(parse_scenario(scenario(ngram(1.0), output=200, version=version,
                                                  asynchronous=asynchronous), "t"))
    assert len(always.iterations) < len(it)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_dynamic_schedule_proposes_by_the_steps_number_of_requests(asynchronous):
    """vLLM 0.33.0's `num_speculative_tokens_per_batch_size` [[1, 1, 3], [2, 256, 1]]: after a
    step of one request the drafter proposes 3 drafts, after a step of two 1; every draft
    accepted, so a request alone samples 4 tokens a step and beside another 2. The drafter's
    passes are the step's (draft_time_ratio 0.5 of the linear model's decode step: a step
    of n requests with K passes takes base + K x 0.5 x base on a model without per-token
    time)."""
    spec = {"method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 1.0,
            "draft_time_ratio": 0.5,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 256, 1]]}
    data = scenario(spec, output=40, num_requests=2, version="0.33.0",
                    asynchronous=asynchronous)
    data["workload"]["arrivals"] = {"process": "poisson", "qps": 1000.0}  # (both at once)
    res = run_scenario(parse_scenario(data, "t"))
    it = res.iterations
    assert (res.requests["num_generated_tokens"] == 40).all()
    # Each step's verified drafts are those the step before it proposed, by its batch.
    seqs, verified = it["num_seqs"].tolist(), it["num_spec_tokens"].tolist()
    for j in range(1, len(it)):
        proposed = 3 if seqs[j - 1] == 1 else 1
        assert verified[j] <= seqs[j] * proposed
    together = it[(it["num_seqs"] == 2) & (it["num_spec_tokens"] > 0)]
    alone = it[(it["num_seqs"] == 1) & (it["num_spec_tokens"] > 0)]
    assert len(together) and len(alone)
    # 1 draft each (but the first step together: the first request's 3 from alone)
    assert (together["num_spec_tokens"].iloc[1:] == 2).all()
    assert set(alone["num_spec_tokens"]) <= {1, 3}  # (its first alone: the 1 proposed before)
    assert 3 in set(alone["num_spec_tokens"])
    # The drafter's passes on decode steps: 1 after a step of two requests, 3 after one
    # alone (none where no request can use drafts: its last steps).
    base = STEP_S
    decodes = it[it["num_prefill_tokens"] == 0]
    passes = [round((d - base) / (0.5 * base), 6) for d in decodes["duration_s"]]
    for n, k in zip(decodes["num_seqs"], passes, strict=True):
        assert k in ((0, 3) if n == 1 else (0, 1))
    assert {1, 3} <= set(passes)
    # Static k = 3: more drafts, so more tokens a step beside each other, and longer steps.
    static = {key: value for key, value in spec.items()
              if key != "num_speculative_tokens_per_batch_size"}
    fixed = run_scenario(parse_scenario({**data, "replica": {**data["replica"], "scheduler": {
        **data["replica"]["scheduler"], "speculative": static}}}, "t"))
    assert fixed.iterations["num_spec_tokens"].max() == 6


def test_a_dynamic_k_of_0_proposes_nothing_but_runs_the_drafters_first_pass():
    """[[1, 1, 2], [2, 256, 0]]: beside another request no drafts are proposed (each step
    then computes one token a request), but vLLM's drafter still runs its first pass, to keep
    its KV in step (`propose`: "the prefill forward pass above already ran"): a decode step
    of two requests takes base + 1 x 0.5 x base."""
    spec = {"method": "eagle", "num_speculative_tokens": 2, "acceptance_rate": 1.0,
            "draft_time_ratio": 0.5,
            "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 256, 0]]}
    data = scenario(spec, output=30, num_requests=2, version="0.33.0")
    data["workload"]["arrivals"] = {"process": "poisson", "qps": 1000.0}
    it = run_scenario(parse_scenario(data, "t")).iterations
    pair = it[(it["num_seqs"] == 2) & (it["num_prefill_tokens"] == 0)]
    assert len(pair) > 3
    assert (pair["num_spec_tokens"].iloc[1:] == 0).all()  # (no drafts after a pair's step)
    passes = sorted({round((d - STEP_S) / (0.5 * STEP_S), 6) for d in pair["duration_s"]})
    assert passes[-1] == 1  # one pass, no more (0: its last steps, drafts of no use)


@pytest.mark.parametrize(("schedule", "extra", "field", "words"), [
    ([[2, 8, 3]], {}, "num_speculative_tokens_per_batch_size", "must start at 1"),
    ([[1, 8, 3], [4, 16, 2]], {}, "num_speculative_tokens_per_batch_size", "not overlap"),
    ([[1, 8]], {}, "num_speculative_tokens_per_batch_size", "[first, last, k]"),
    ([[1, 8, -1]], {}, "num_speculative_tokens_per_batch_size", ">= 0"),
    ([[1, 8, 2]], {"engine_version": "0.15.1"}, "num_speculative_tokens_per_batch_size",
     "set engine_version: 0.33.0")])
def test_a_dynamic_schedule_vllm_refuses_is_refused(schedule, extra, field, words):
    data = scenario(None)
    data["replica"]["scheduler"] = {
        "name": "vllm_v1", "engine_version": "0.33.0", **extra,
        "speculative": {"method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 0.5,
                        "num_speculative_tokens_per_batch_size": schedule}}
    with pytest.raises(InputError, match=words.replace("[", r"\[")) as err:
        parse_scenario(data, "t")
    assert field in str(err.value) and len(err.value.lines()) == 1


def test_the_dense_schedule_is_vllms():
    """Gaps and the tail carry the k before them; every k at most num_speculative_tokens
    (`build_dynamic_sd_schedule_lookup`)."""
    from sim.schedulers.vllm_config import SpeculativeConfig

    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, acceptance_rate=0.5,
                             num_speculative_tokens_per_batch_size=[[1, 2, 5], [5, 6, 1]])
    assert spec.drafts_by_batch_size(8) == (0, 3, 3, 3, 3, 1, 1, 1, 1)


def test_only_ngram_lookups_may_miss():
    with pytest.raises(InputError, match="only ngram lookups") as err:
        parse_scenario(scenario({"method": "eagle", "num_speculative_tokens": 2,
                                 "acceptance_rate": 0.5, "match_rate": 0.5}), "t")
    assert "match_rate" in str(err.value) and len(err.value.lines()) == 1


def test_export_reports_vllms_spec_decode_fields():
    from sim.export.vllm import vllm_result

    res = run_scenario(parse_scenario(scenario(ngram(0.5), output=40, num_requests=5), "t"))
    data = json.loads(json.dumps(vllm_result(res)))
    spec = res.summary["speculative"]
    assert data["spec_decode_acceptance_length"] == spec["acceptance_length"]
    assert data["spec_decode_num_drafts"] == spec["num_drafts"]
    assert len(data["spec_decode_per_position_acceptance_rates"]) == 3
    assert math.isclose(data["mean_tpot_ms"], 1e3 * res.requests["tpot_s"].mean())


@pytest.mark.parametrize(("spec", "extra", "field", "words"), [
    ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": [0.5, 0.5]}, {},
     "acceptance_rate", "one rate per draft position"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": 1.5}, {},
     "acceptance_rate", "between 0 and 1"),
    ({"method": "ngram", "num_speculative_tokens": 2}, {}, "acceptance_rate", "one of the two"),
    ({"method": "ngram", "num_speculative_tokens": 2, "per_position_acceptance": [0.5, 0.6]},
     {}, "per_position_acceptance", "never increase"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "acceptance_rate": 0.5}, {},
     "draft_time_ratio", "a draft model's time"),
    (ngram(0.5), {"async_scheduling": True}, "async_scheduling", "only with EAGLE/MTP"),
    (ngram(0.5), {"min_chunk_tokens": 16}, "min_chunk_tokens", "not modelled"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": "0.7"}, {},
     "acceptance_rate", "a rate between 0 and 1, or a list of them"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": float("nan")}, {},
     "acceptance_rate", "a rate between 0 and 1, or a list of them"),
    ({"method": "eagle", "num_speculative_tokens": 4, "acceptance_rate": 0.5},
     {"engine_version": "0.33.0", "max_num_batched_tokens": 4}, "max_num_batched_tokens",
     "lookahead slots"),
    # 0.33.0 pads a decode admitted from the queue to 1 + k tokens: a smaller budget never
    # schedules it (vLLM would wait for ever), a smaller threshold fails vLLM's assertion.
    ({"method": "ngram", "num_speculative_tokens": 4, "acceptance_rate": 0.5},
     {"engine_version": "0.33.0", "max_num_batched_tokens": 4}, "max_num_batched_tokens",
     "would never schedule one"),
    ({"method": "draft_model", "num_speculative_tokens": 1, "acceptance_rate": 0.5,
      "draft_time_ratio": 0.1},
     {"engine_version": "0.33.0", "max_num_batched_tokens": 2, "max_num_seqs": 2},
     "max_num_batched_tokens", "beside its draft model's 1 slot"),
    ({"method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 0.5},
     {"engine_version": "0.33.0", "long_prefill_token_threshold": 2},
     "long_prefill_token_threshold", "1 \\+ k = 4 tokens, which a smaller threshold fails"),
])
def test_settings_refused_name_the_field(spec, extra, field, words):
    data = scenario(None)
    data["replica"]["scheduler"] = {"name": "vllm_v1", "speculative": spec, **extra}
    with pytest.raises(InputError, match=words) as err:
        parse_scenario(data, "t")
    assert field in str(err.value)
    assert len(err.value.lines()) == 1  # one line, not one per branch of a union


def test_not_modelled_where_refused():
    data = scenario(ngram(0.5))
    data["replica"].update(model="tiny", latency={"kind": "roofline"},
                           parallelism={"pipeline": 2})
    with pytest.raises(InputError, match="on a pipeline is not modelled"):
        run_scenario(parse_scenario(data, "t"))
    other = scenario(None)
    other["replica"]["scheduler"] = {"name": "chunked_prefill", "speculative": ngram(0.5)}
    with pytest.raises(InputError, match="speculative"):
        parse_scenario(other, "t")


@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b"])
def test_the_default_drafters_prompt_pass_is_one_layer_of_the_targets(model):
    """Over a prompt both models compute per token and sample one row: an EAGLE head's pass
    is one decoder layer of the target's (1/32 of Llama-3.1-8B's, 1/80 of the 70B's, 1/48 of
    Qwen3-30B-A3B's), not its share of the weights a decode step reads (the LM head's too:
    9% for the 8B)."""
    from sim.hardware.models import MODELS
    from sim.latency.base import (
        BatchShape,
        DraftingLatency,
        drafter_prompt_ratio,
        drafter_time_ratio,
    )
    from sim.latency.constant import ConstantLatency

    shape = MODELS.get(model)
    prompt = drafter_prompt_ratio("eagle", shape)
    assert prompt == pytest.approx(1 / shape.num_layers, rel=0.03)
    assert drafter_time_ratio("eagle", shape) > 1.5 * prompt
    target = ConstantLatency(ConstantLatency.Config(kind="constant", iteration_s=1.0), shape,
                             None)
    drafting = DraftingLatency(target, drafter_time_ratio("eagle", shape), 2, prompt)
    only_prompt = BatchShape(num_prefill_tokens=100, num_prefill_seqs=1)
    assert drafting.iteration_time_s(only_prompt) == pytest.approx(1 + prompt)


def test_lookahead_slots_count_toward_the_future_a_newcomer_reserves():
    """vLLM 0.33.0 gives EAGLE's 5 lookahead slots at admission: a 47-token prompt with 3
    tokens to come takes 47 + 5 = 52 slots, all 4 blocks of 16, which already hold its last
    2 tokens. With servesim's `decode_reserve_tokens` it reserves no further block for them
    (before, one more: 5 of 4 blocks, and it waited for ever, alone)."""
    data = scenario({"method": "eagle", "num_speculative_tokens": 5, "acceptance_rate": 0.0,
                     "draft_time_ratio": 0.0}, prompt=47, output=3, version="0.33.0",
                    enable_chunked_prefill=False, max_num_batched_tokens=256, max_num_seqs=2,
                    decode_reserve_tokens=8)
    data["replica"]["kv_cache"] = {"block_size": 16, "num_blocks": 5}  # (4 usable)
    res = run_scenario(parse_scenario(data, "t"))
    assert res.requests["status"].tolist() == ["finished"]
