"""SGLang's speculative decoding (`sglang`'s `speculative`, rule 12; `sim.schedulers.sglang_spec`)
exactly, on a linear step: every decode verifies D tokens and yields the accepted drafts plus
one; each decode step tops a request up to its committed KV plus 2L slots, and retracts
requests (fewest outputs first, the longest prompt among equals, to the queue's back) where
the top-ups do not fit; in the overlap loop a request whose queued result finishes it sits the
step out; SGLang's defaults by model; the EAGLE drafter's time; the settings refused."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from sim import run_scenario
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.hardware.models import MODELS
from sim.latency.base import BatchShape, EagleDraftingLatency
from sim.schedulers.sglang_spec import SGLangSpeculativeConfig

BASE_S, PER_TOKEN_S = 0.01, 0.001


def eagle(rate: float | list[float], steps: int = 3, **extra: Any) -> dict[str, Any]:
    return {"algorithm": "eagle", "num_steps": steps, "eagle_topk": 1,
            "num_draft_tokens": steps + 1, "acceptance_rate": rate, "draft_time_ratio": 0.0,
            **extra}


def scenario(spec: dict[str, Any] | None, requests: list[tuple[float, int, int]], *,
             num_blocks: int = 10_000, overlap: bool = False, **scheduler: Any
             ) -> dict[str, Any]:
    """`requests`: (arrival_s, prompt tokens, output tokens) each, as a trace's rows."""
    path = Path(tempfile.mkdtemp()) / "trace.csv"
    path.write_text("t,p,o\n" + "".join(f"{t},{p},{o}\n" for t, p, o in requests))
    sched = {"name": "sglang", "overlap_schedule": overlap, "chunked_prefill_size": 4096,
             **scheduler}
    if spec is not None:
        sched["speculative"] = spec
    return {"name": "sglang-spec", "seed": 5,
            "workload": {"format": "csv", "path": str(path), "time_unit": "s",
                         "columns": {"arrival": "t", "prompt_tokens": "p",
                                     "output_tokens": "o"},
                         "ignore_eos": True},  # (outputs known, as the golden workloads')
            "replica": {"scheduler": sched,
                        "latency": {"kind": "linear", "base_s": BASE_S,
                                    "per_token_s": PER_TOKEN_S},
                        "kv_cache": {"block_size": 1, "num_blocks": num_blocks},
                        "engine": "none"},
            "record_token_times": True}


def run(data: dict[str, Any]):
    return run_scenario(parse_scenario(data, "t"))


def test_every_draft_accepted_yields_d_tokens_a_step():
    # Prompt 100 (first token), then 4 tokens a step: 1 + 4 + 4 + 4 = 13 in 3 decodes, each
    # computing D = 4 tokens.
    res = run(scenario(eagle(1.0), [(0.0, 100, 13)]))
    it, req = res.iterations, res.requests.iloc[0]
    assert it["num_prefill_tokens"].tolist() == [100, 0, 0, 0]
    assert it["num_decode_tokens"].tolist() == [0, 1, 1, 1]
    assert it["num_spec_tokens"].tolist() == [0, 3, 3, 3]
    assert it["duration_s"].tolist() == pytest.approx([BASE_S + 100 * PER_TOKEN_S]
                                                      + [BASE_S + 4 * PER_TOKEN_S] * 3)
    # Each decode step holds the committed KV plus 2L = 8 slots: 100 + 8, 104 + 8, 108 + 8.
    assert it["num_kv_blocks_used"].tolist() == [100, 108, 112, 116]
    assert req["status"] == "finished" and req["num_generated_tokens"] == 13
    assert (req["num_drafts_verified"], req["num_drafts_accepted"]) == (9, 9)
    spec = res.summary["speculative"]
    assert spec["acceptance_length"] == pytest.approx(4.0)  # SGLang's accept length
    assert spec["acceptance_rate"] == pytest.approx(100.0)


def test_no_draft_accepted_still_computes_d_tokens_for_one():
    res = run(scenario(eagle(0.0), [(0.0, 50, 4)]))
    it = res.iterations
    assert it["num_spec_tokens"].tolist() == [0, 3, 3, 3]
    assert res.requests.iloc[0]["num_generated_tokens"] == 4
    # The rejected slots stay held: 49 + 8 at the first decode, then one more each step.
    assert it["num_kv_blocks_used"].tolist() == [50, 58, 59, 60]


def test_overlap_tops_up_from_the_whole_prompt_while_its_token_is_in_flight():
    """The first decode is scheduled while the prompt's step runs: SGLang has committed the
    prompt's KV (100) as it allocated it, so the top-up is 100 + 8; each later one reads the
    outputs known then (one step behind): 100 + 1 - 1, 104, 108 (found by a held-out
    workload, `tools/golden/heldout_sglang_spec.py` seed 22)."""
    res = run(scenario(eagle(1.0), [(0.0, 100, 13)], overlap=True))
    assert res.iterations["num_kv_blocks_used"].tolist() == [100, 108, 108, 112, 116]


def test_a_step_past_the_last_token_is_cut_at_it():
    # 1 + 4 + 4 = 9 but 7 wanted: the second decode's run is cut at the last token.
    res = run(scenario(eagle(1.0), [(0.0, 20, 7)]))
    assert res.requests.iloc[0]["num_generated_tokens"] == 7
    assert len(res.iterations) == 3


def test_retraction_takes_fewest_outputs_then_longest_prompt_to_the_queues_back():
    """Three requests decode; KV for their top-ups runs out. SGLang retracts the one with the
    fewest outputs, the longest prompt among equals, until the rest fit, and queues it behind
    the waiting request D."""
    # A, B, C admitted together (outputs known; reserve-free admission of SGLang's in-order
    # check). At the first decode each needs committed + 2L = prompt + 8 slots.
    requests = [(0.0, 30, 40), (0.0, 34, 40), (0.0, 30, 40), (0.5, 10, 5)]
    res = run(scenario(eagle(0.0), requests, num_blocks=230))
    req = res.requests.set_index("request_id")
    it = res.iterations
    assert (req["status"] == "finished").all()
    # B (34-token prompt) goes first among the equal-output A, B, C.
    retracted = req.index[req["num_preemptions"] > 0].tolist()
    assert retracted and retracted[0] == 1
    assert it["num_preempted"].sum() == req["num_preemptions"].sum()
    # Once A and C finish, D (10 tokens) and B again (its prompt and 39 outputs) are prefilled
    # together, D first.
    assert 10 + 34 + 39 in it["num_prefill_tokens"].tolist()
    # Never more KV held than there is.
    assert (it["num_kv_blocks_used"] <= 230).all()


def test_a_retracted_requests_last_token_left_is_extended_alone():
    """The retraction above with chunks of 82: D (10 tokens) and B again (its prompt and 39
    outputs, 73 tokens) share a prefill of 82, which leaves B one token. That token is the
    last extend of SGLang's chunked request, a prefill batch of its own where B samples its
    40th and last output, not a verify of D tokens beside D's (`spec_eos_ngram_chunked`)."""
    requests = [(0.0, 30, 40), (0.0, 34, 40), (0.0, 30, 40), (0.5, 10, 5)]
    res = run(scenario(eagle(0.0), requests, num_blocks=230, chunked_prefill_size=82))
    req = res.requests.set_index("request_id")
    it = res.iterations.reset_index(drop=True)
    assert req.loc[1, "num_preemptions"] == 1
    # (The first prefill is 82 tokens too: A, B and 18 of C's.)
    i = it.index[it["num_prefill_tokens"] == 82].tolist()
    assert len(i) == 2 and it.loc[i[1], "num_seqs"] == 2
    i = i[1:]
    last = it.loc[i[0] + 1]
    assert (last["num_seqs"], last["num_spec_tokens"]) == (1, 0)
    assert last["duration_s"] == pytest.approx(BASE_S + 1 * PER_TOKEN_S)
    assert req.loc[1, "finish_s"] == pytest.approx(last["start_s"] + last["duration_s"])
    # D's four verifies follow, one at a time.
    assert it.loc[i[0] + 2:, "num_spec_tokens"].tolist() == [3, 3, 3, 3]
    assert req.loc[3, "status"] == "finished"


def test_a_request_the_top_up_outgrows_is_aborted_and_the_queue_starts_at_once():
    """Admission counts a prompt, its outputs and 3 spare slots (372 + 9 + 3 = 384), not the
    decode step's top-up: with no draft accepted, the sixth decode would need 377 + 8 > 384
    slots; the request is the last of its batch, so SGLang aborts it (counting it retracted
    once), and its loop passes again at once: B, waiting since 0.01 s, starts then."""
    res = run(scenario(eagle(0.0), [(0.0, 372, 9), (0.01, 50, 4)], num_blocks=384))
    a, b = res.requests.set_index("request_id").loc[0], res.requests.set_index(
        "request_id").loc[1]
    assert a["status"] == "failed" and a["reason"].startswith("kv_oom")
    assert (a["num_generated_tokens"], a["num_preemptions"]) == (6, 1)
    assert a["failed_s"] == pytest.approx(0.382 + 5 * 0.014)
    assert b["status"] == "finished" and b["first_scheduled_s"] == a["failed_s"]
    assert res.iterations["num_kv_blocks_used"].tolist()[:6] == [372, 380, 381, 382, 383, 384]


def test_overlap_after_an_abort_the_queue_starts_when_the_verify_in_flight_ends():
    """The same abort in the overlap loop, decided at 0.452 s while the request's last verify
    runs (to 0.466 s): SGLang first processes that batch (`event_loop_overlap`), then
    passes again with the requests arrived by then, so C (0.46 s) starts with B (as a
    recording of SGLang's own overlap loop on the same three requests does)."""
    res = run(scenario(eagle(0.0), [(0.0, 372, 9), (0.01, 50, 4), (0.46, 30, 3)],
                       num_blocks=384, overlap=True))
    reqs = res.requests.set_index("request_id")
    assert reqs.loc[0, "failed_s"] == pytest.approx(0.452)
    assert reqs.loc[1, "first_scheduled_s"] == reqs.loc[2, "first_scheduled_s"] == (
        pytest.approx(0.466))
    assert res.iterations["num_prefill_tokens"].tolist()[7] == 80


def test_overlap_leaves_out_a_request_whose_queued_result_finishes_it():
    """In the overlap loop, a request with one known token left whose verify is in flight sits
    the next decode out; one with more left is scheduled again (its result then dropped)."""
    res = run(scenario(eagle(1.0), [(0.0, 20, 2)], overlap=True))
    it = res.iterations
    # Prefill (its first token), then one decode whose queued result finishes it: no step
    # scheduled after it.
    assert it["num_spec_tokens"].tolist() == [0, 3]
    res = run(scenario(eagle(1.0), [(0.0, 20, 4)], overlap=True))
    # Outputs known 1 (the prefill's) + 1 < 4 while the first decode runs: scheduled again,
    # and dropped when the first finishes it (1 + 4 >= 4).
    assert res.iterations["num_spec_tokens"].tolist() == [0, 3, 3]
    assert res.requests.iloc[0]["num_generated_tokens"] == 4


@pytest.mark.parametrize(("model", "algorithm", "expected"), [
    ("llama-3.1-8b", "eagle", (5, 4, 8)),
    ("llama-3.1-8b", "eagle3", (5, 4, 8)),
    ("qwen2.5-7b", "eagle", (3, 1, 4)),
    ("mixtral-8x7b", "nextn", (3, 1, 4)),
    ("llama-3.1-8b", "standalone", (3, 1, 4)),
    ("llama-3.1-8b", "ngram", (1, 10, 12)),
])
def test_sglangs_own_numbers_by_model(model, algorithm, expected):
    spec = {"algorithm": algorithm, "acceptance_rate": 0.5}
    if algorithm == "standalone":
        spec["draft_time_ratio"] = 0.1
    data = scenario(spec, [(0.0, 10, 5)])
    data["replica"].update(model=model, latency={"kind": "roofline"})
    sc = parse_scenario(data, "t")
    got = sc.replica.scheduler.speculative
    assert (got.num_steps, got.eagle_topk, got.num_draft_tokens) == expected
    assert sc.replica.scheduler.max_num_seqs == 48  # reset for speculative decoding
    data["replica"]["scheduler"]["max_running_requests"] = 100
    assert parse_scenario(data, "t").replica.scheduler.max_num_seqs == 100


@pytest.mark.parametrize(("spec", "extra", "field", "words"), [
    ({"algorithm": "eagle", "acceptance_rate": 0.5}, {}, "num_steps", "not known here"),
    ({"algorithm": "eagle", "num_steps": 3, "acceptance_rate": 0.5}, {}, "num_steps",
     "together"),
    (eagle(0.5, num_draft_tokens=6), {}, "num_draft_tokens", "num_steps + 1"),
    ({**eagle(0.5), "eagle_topk": 2, "num_draft_tokens": 20}, {}, "num_draft_tokens",
     "tree"),
    ({**eagle(0.5), "algorithm": "standalone", "draft_time_ratio": None}, {},
     "draft_time_ratio", "its own"),
    (eagle([0.5, 0.5]), {}, "acceptance_rate", "3: num_steps"),
    (eagle(0.5), {"mixed_chunk": True}, "mixed_chunk", "not modelled"),
])
def test_settings_refused(spec, extra, field, words):
    data = scenario(spec, [(0.0, 10, 5)], **extra)
    data["replica"]["model"] = "tiny"  # (no architecture SGLang chooses by)
    with pytest.raises(InputError) as err:
        parse_scenario(data, "t")
    problems = err.value.problems
    assert any(name.endswith(field) and words in why for name, _, why in problems), problems


def prefixed(spec: dict[str, Any] | None, rows: list[tuple[float, int, int, list[int]]]
             ) -> dict[str, Any]:
    """`scenario` on a Mooncake trace (ids of 512-token prefix blocks), the radix cache on."""
    import json

    data = scenario(spec, [])
    path = Path(tempfile.mkdtemp()) / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * t, "input_length": p,
                                        "output_length": o, "hash_ids": ids}) + "\n"
                            for t, p, o, ids in rows))
    data["workload"] = {"format": "mooncake", "path": str(path)}
    data["replica"]["prefix_caching"] = True
    return data


@pytest.mark.parametrize("spec, hit", [
    (None, 1024), (eagle(0.5), 1023), ({**eagle(0.5), "algorithm": "nextn"}, 1023),
    ({"algorithm": "ngram", "acceptance_rate": 0.5}, 1024),
    ({"algorithm": "standalone", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4,
      "acceptance_rate": 0.5, "draft_time_ratio": 0.1}, 1024),
])
def test_eagle_keys_the_radix_cache_by_token_pairs(spec, hit):
    """B shares A's first two 512-token blocks. EAGLE's tree holds n - 1 tokens of n (token
    pairs as keys): B reuses 1023 of them; n-gram's and a draft model's trees hold tokens."""
    rows = [(0.0, 1100, 20, [7, 8, 9]), (5.0, 1100, 20, [7, 8, 10])]
    for overlap in (False, True):
        data = prefixed(spec, rows)
        data["replica"]["scheduler"]["overlap_schedule"] = overlap
        req = run(data).requests.set_index("request_id")
        assert req["num_cached_tokens"].tolist() == [0, hit]
        assert (req["status"] == "finished").all()


def test_eagle_drafter_time():
    """A decode step of n requests adds (S - 1) draft passes of n * K tokens and one extend of
    the verified width; a prompt's chunk one extend of its tokens; each `ratio` times the
    target's time for them (a linear model: base + per token)."""
    from sim.latency.linear import LinearLatency

    target = LinearLatency(LinearLatency.Config(kind="linear", base_s=1.0, per_token_s=0.1),
                           MODELS.get("tiny"), None)
    model = EagleDraftingLatency(target, 0.5, num_steps=3, topk=2)
    decode = BatchShape(num_decode_tokens=4, num_sampled_tokens=4 + 12, decode_kv_tokens=400,
                        num_spec_tokens=12)
    # Target 1 + 1.6; drafts 2 x (1 + 0.8); extend 1 + 1.6; the drafter's at half.
    assert model.iteration_time_s(decode) == pytest.approx(2.6 + 0.5 * (2 * 1.8 + 2.6))
    prompt = BatchShape(num_prefill_tokens=100, num_prefill_seqs=1, num_sampled_tokens=1,
                        prefill_attn_pairs=5050, prefill_kv_tokens=100)
    assert model.iteration_time_s(prompt) == pytest.approx(11.0 + 0.5 * 11.0)


def test_acceptance_positions_follow_the_draft_depth():
    """A tree of K > 1 verifies D - 1 drafts, of which at most S (its depth) are accepted."""
    spec = SGLangSpeculativeConfig(algorithm="eagle", num_steps=2, eagle_topk=2,
                                   num_draft_tokens=5, acceptance_rate=[0.9, 0.5])
    assert spec.num_speculative_tokens == 4
    assert spec.draws() == [0.9, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("scheduler", [
    {"name": "sglang", "speculative": {"algorithm": "eagle3", "acceptance_rate": 0.5}},
    {"name": "vllm_v1", "speculative": {"method": "eagle", "num_speculative_tokens": 3,
                                        "acceptance_rate": 0.5}},
])
def test_a_one_layer_drafter_takes_its_kv_and_weights_from_the_pool(scheduler):
    """An EAGLE/MTP drafter keeps a layer's KV per token slot in the same pool, and its layer's
    weights beside the target's: Llama-3.1-8B's 32 layers hold 32/33 of the tokens, a little
    less for the weights."""
    from sim.engine.cluster import kv_cache_for

    def num_blocks(sched: dict[str, Any]) -> int:
        data = scenario(None, [(0.0, 10, 5)])
        # (SGLang's drafter on pages of one token: refused on larger ones.)
        kv_cache = {"block_size": 1} if sched["name"] == "sglang" else {}
        data["replica"].update(model="llama-3.1-8b", gpu="h100-sxm", kv_cache=kv_cache,
                               latency={"kind": "roofline"}, scheduler=sched)
        cfg = parse_scenario(data, "t").replica
        return kv_cache_for(cfg, cfg.model_shape).num_blocks

    plain = num_blocks({"name": scheduler["name"]})
    drafting = num_blocks(scheduler)
    assert plain * 32 / 33 * 0.98 < drafting < plain * 32 / 33


def token_ids(request_id: int, num_tokens: int) -> tuple[int, ...]:
    """A prompt of its own tokens, an id per token chained from the ones before it."""
    ids, last = [], request_id
    for i in range(num_tokens):
        last = hash((last, request_id * 1000 + i))
        ids.append(last)
    return tuple(ids)


def test_a_retraction_evicts_room_for_the_requests_kept_its_own_prompt_too():
    """A (77 tokens, 5 out) and B (87, 3) decode in 182 slots, EAGLE (3, 1, 4) accepting
    nothing: each step tops a request up to committed + 8. B's prompt (86 pair keys) was
    cached when its prefill ended. At the fourth step A needs 1 slot and B 1, and 1 is
    free: B (fewer outputs) is retracted; its 10 private slots come back, 11 free, fewer than
    the 20 SGLang evicts for the one request kept, so B's own cached prompt goes, and B
    computes all 89 tokens (prompt and outputs) again. Without that eviction it would reuse
    86 and compute 3 (found by comparing the two on random workloads)."""
    from sim.config.scenario import parse_scenario
    from sim.core.request import Request, Status
    from sim.engine.cluster import Cluster

    data = scenario(eagle(0.0), [], num_blocks=182)
    data["workload"] = {"format": "synthetic", "num_requests": 1,
                        "arrivals": {"process": "poisson", "qps": 1.0},
                        "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                    "output": {"dist": "fixed", "value": 1}}}
    data["replica"]["prefix_caching"] = True
    data["replica"]["latency"] = {"kind": "constant", "iteration_s": 0.01}
    a = Request(0, 0.0, 77, 5, token_ids(0, 77), 1)
    b = Request(1, 0.015, 87, 3, token_ids(1, 87), 1)
    cluster = Cluster(parse_scenario(data, "t"), fast_forward=False)
    replica = cluster.replicas[0]
    replica.plans = []
    cluster.run([a, b])
    assert a.status is Status.FINISHED and b.status is Status.FINISHED
    steps = [(dict(p.num_scheduled_tokens), list(p.preempted_ids)) for p in replica.plans]
    assert steps[:6] == [({0: 77}, []), ({0: 4}, []), ({1: 87}, []), ({0: 4, 1: 4}, []),
                         ({0: 4}, [1]), ({1: 89}, [])]
    assert (b.num_preemptions, b.num_cached_tokens) == (1, 0)
