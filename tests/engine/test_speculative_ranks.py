"""Speculative decoding on data-parallel ranks in lockstep (vLLM `--data-parallel-size` with a
`--speculative-config`): a lone request decodes on its rank exactly as on one replica, drafts,
acceptance, drafter time and all, synchronous or async, each release (its rank's dummy batches
take no longer than its own steps on a linear model); the drafter's passes run in lockstep,
padded to the busiest rank's; and the ranks' CUDA-graph ceiling widens with a decode's drafts,
as vLLM sizes it."""

from __future__ import annotations

import numpy as np
import pytest

from sim.core.request import Request, Status
from sim.engine.cluster import Cluster, make_latency
from sim.engine.data_parallel import DataParallelGroup
from sim.latency.base import BatchShape
from sim.results.records import token_times
from tests.engine.test_data_parallel import _scenario as dp_scenario


def _scenario(scheduler, data=2, latency=None):
    """`test_data_parallel`'s scenario (Qwen3-30B-A3B, its linear model) with `scheduler`'s
    vLLM settings."""
    return dp_scenario(data=data, scheduler={"name": "vllm_v1", **scheduler},
                       **({"latency": latency} if latency else {}))


def _times(cluster, req):
    """When `req`'s tokens came out, one entry per step that sampled (as the results see
    them)."""
    return token_times([req], [replica.log for replica in cluster.replicas])[1]


@pytest.mark.parametrize("version", ["0.15.1", "0.33.0"])
@pytest.mark.parametrize(("method", "async_scheduling"), [
    ("ngram", False), ("eagle", False), ("eagle", True)])
def test_a_lone_request_on_ranks_decodes_as_on_one_replica(version, method, async_scheduling):
    """A (40-token prompt, 30 tokens out) alone on rank 0 of two: the same steps, with the
    same drafts verified and accepted, as on one replica. On 0.15.1 the other rank's dummy
    batch (one token, its drafter's dummy passes over one) never outlasts A's step on the
    linear model, so A's tokens come out at the same times too. 0.33.0's dummy batch is a
    uniform decode of 1 + k tokens (`execute_dummy_batch`), its drafter's passes over as
    many: no step is shorter than on one replica, and those where A computes fewer tokens
    (its last, its drafts cut at its length; its first decode's drafter passes over one) are
    longer."""
    if version == "0.15.1" and method == "ngram" and async_scheduling:
        pytest.skip("0.15.1 refuses async scheduling with n-gram")
    scheduler = {"engine_version": version, "async_scheduling": async_scheduling,
                 "speculative": {"method": method, "num_speculative_tokens": 3,
                                 "acceptance_rate": 0.6, "draft_time_ratio": 0.1}}
    runs = []
    for data in (2, 1):
        cluster = Cluster(_scenario(scheduler, data), fast_forward=False)
        req = Request(0, 0.0, 40, 30)
        cluster.run([req])
        assert req.status is Status.FINISHED and req.replica_id == 0
        runs.append((cluster, req))
    (ranks, a), (alone, b) = runs
    assert isinstance(ranks.front[0], DataParallelGroup)
    assert (a.num_drafts_verified, a.num_drafts_accepted) == (
        b.num_drafts_verified, b.num_drafts_accepted)
    assert 0 < a.num_drafts_accepted < a.num_drafts_verified
    if version == "0.15.1":
        np.testing.assert_array_equal(_times(ranks, a), _times(alone, b))
        assert a.finish_s == b.finish_s
    else:
        steps = ranks.replicas[0].log.columns["duration_s"]
        own = alone.replicas[0].log.columns["duration_s"]
        assert len(steps) == len(own)
        assert all(x >= y for x, y in zip(steps, own, strict=True))
        assert any(x > y for x, y in zip(steps, own, strict=True))
    spec = ranks.replicas[0].log.columns["num_spec_tokens"]
    assert list(spec) == list(alone.replicas[0].log.columns["num_spec_tokens"])
    # The other rank ran a dummy batch beside each of A's steps, and logged none.
    assert len(ranks.replicas[1].log) == 0 and ranks.front[0].num_dummy_forwards > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_cut_by_the_horizon_takes_back_only_what_it_counted(async_scheduling):
    """The clock stops with a step in flight: it never ends, and its tokens are taken back,
    on ranks as on one replica (a synchronous rank's step counted no placeholders when
    sent, so none is taken back: found by a review, where the counts went negative)."""
    scheduler = {"engine_version": "0.33.0", "async_scheduling": async_scheduling,
                 "speculative": {"method": "eagle", "num_speculative_tokens": 3,
                                 "acceptance_rate": 0.6, "draft_time_ratio": 0.1}}
    states = []
    for data in (2, 1):
        scenario = _scenario(scheduler, data).model_copy(update={"horizon_s": 0.105})
        cluster = Cluster(scenario, fast_forward=False)
        req = Request(0, 0.0, 40, 300)
        cluster.run([req])
        state = cluster.replicas[0].state
        states.append((req.num_output_tokens, req.num_placeholders, req.num_computed_tokens,
                       state.num_running_tokens))
        assert req.status is Status.RUNNING and req.num_placeholders == 0
    assert states[0] == states[1]


def test_the_drafter_runs_in_lockstep_padded_to_the_busiest_rank():
    """Qwen3-30B-A3B on two H100s (DP2 x EP2, the roofline), EAGLE k = 3: a step is the
    target's lockstep step, then the drafter's pass over the ranks' prompt tokens and its k
    passes over each rank's sampling requests, each in lockstep with every rank at the most
    of any rank's (vLLM's proposer pads them across the ranks; an idle rank runs its dummy
    pass): more than the same passes at each rank's own count, and more than one rank's
    drafter alone."""
    scheduler = {"speculative": {"method": "eagle", "num_speculative_tokens": 3,
                                 "acceptance_rate": 0.5}}
    cfg = _scenario(scheduler, latency={"kind": "roofline"}).replica
    latency = make_latency(cfg, cfg.model_shape, "<test>")
    inner = latency._model
    ratio, passes = latency._per_pass, latency._num_passes
    assert passes == 3 and 0 < ratio < 0.2
    decodes = BatchShape.decode_only(64, 64 * 900)
    decodes.num_spec_tokens = 3 * 64
    decodes.num_sampled_tokens = 4 * 64
    decodes.num_drafting_seqs = 64
    few = BatchShape.decode_only(4, 4 * 900)
    few.num_spec_tokens, few.num_sampled_tokens, few.num_drafting_seqs = 12, 16, 4
    counts = [int(decodes.num_tokens), int(few.num_tokens)]
    step_s, exchange_s = latency.lockstep_time_s([decodes, few], [max(counts)] * 2)
    target_s, target_exchange_s = inner.lockstep_time_s([decodes, few], [max(counts)] * 2)
    assert exchange_s == target_exchange_s
    drafts = [BatchShape.decode_only(64, 64 * 900), BatchShape.decode_only(4, 4 * 900)]
    padded_s = inner.lockstep_time_s(drafts, [64, 64])[0]
    assert step_s == pytest.approx(target_s + passes * ratio * padded_s, rel=1e-12)
    assert padded_s > inner.lockstep_time_s(drafts, [64, 4])[0]
    # Beside an idle rank's dummy batch, the drafter's dummy passes pad to the busy rank's.
    dummy = BatchShape(num_decode_tokens=1)
    busy_s = latency.lockstep_time_s([decodes, dummy], [int(decodes.num_tokens)] * 2)[0]
    alone_s = inner.lockstep_time_s([decodes, dummy], [int(decodes.num_tokens)] * 2)[0]
    idle = [BatchShape.decode_only(64, 64 * 900), BatchShape.decode_only(0, 0)]
    assert busy_s == pytest.approx(
        alone_s + passes * ratio * inner.lockstep_time_s(idle, [64, 64])[0], rel=1e-12)
    # A prompt's step adds the drafter's pass over it (one layer of the target's).
    prompt = BatchShape(num_prefill_tokens=300, num_prefill_seqs=1, num_sampled_tokens=1,
                        prefill_attn_pairs=300 * 301 // 2, prefill_kv_tokens=300,
                        num_drafting_seqs=1)
    with_prompt_s = latency.lockstep_time_s([prompt, dummy], [300, 300])[0]
    prompt_only = BatchShape(num_prefill_tokens=300, num_prefill_seqs=1,
                             prefill_attn_pairs=300 * 301 // 2, prefill_kv_tokens=300)
    expected = (inner.lockstep_time_s([prompt, dummy], [300, 300])[0]
                + latency._prompt_ratio * inner.lockstep_time_s(
                    [prompt_only, BatchShape()], [300, 300])[0]
                + passes * ratio * inner.lockstep_time_s(
                    [BatchShape.decode_only(1, 0), BatchShape.decode_only(0, 0)], [1, 1])[0])
    assert with_prompt_s == pytest.approx(expected, rel=1e-12)


def test_a_dynamic_schedule_is_refused_on_ranks():
    """vLLM turns dynamic speculative decoding off with data parallelism (the ranks could
    choose different drafts and deadlock): refused, one line naming the field."""
    from sim.config.errors import InputError

    scheduler = {"engine_version": "0.33.0", "speculative": {
        "method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 0.5,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 256, 1]]}}
    with pytest.raises(InputError, match="turns dynamic speculative decoding off") as err:
        Cluster(_scenario(scheduler))
    assert "replica.scheduler.speculative.num_speculative_tokens_per_batch_size" in str(
        err.value)
    assert len(err.value.lines()) == 1


@pytest.mark.parametrize(("version", "width"), [("0.15.1", 1), ("0.33.0", 4)])
def test_an_idle_ranks_dummy_batch_and_its_drafter(version, width):
    """An idle rank's dummy batch: 0.33.0 runs a uniform decode of 1 + k tokens, 0.15.1 one
    token (`execute_dummy_batch`), and its drafter's dummy passes over as many; so a step of
    dummies alone (the ranks yet to learn they are all idle) takes the drafter's time too."""
    scheduler = {"engine_version": version, "speculative": {
        "method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 0.5}}
    scenario = _scenario(scheduler, latency={"kind": "roofline"})
    (group,) = Cluster(scenario, fast_forward=False).front
    dummy = group.dummy
    assert (dummy.num_tokens, dummy.num_drafting_seqs) == (width, width)
    latency = group.latency
    step_s = latency.lockstep_time_s([dummy, dummy], [width, width])[0]
    target_s = latency._model.lockstep_time_s([dummy, dummy], [width, width])[0]
    assert step_s > target_s
    plain = Cluster(_scenario({"engine_version": version}, latency={"kind": "roofline"}),
                    fast_forward=False).front[0].dummy
    assert (plain.num_tokens, plain.num_drafting_seqs) == (1, 0)


@pytest.mark.parametrize(("scheduler", "limit"), [
    ({"max_num_seqs": 64}, 128),
    ({"max_num_seqs": 64, "speculative": {"method": "eagle", "num_speculative_tokens": 3,
                                          "acceptance_rate": 0.5}}, 512),
    ({"max_num_seqs": 32, "speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                          "acceptance_rate": 0.5}}, 192),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 256, "speculative": {
        "method": "eagle", "num_speculative_tokens": 3, "acceptance_rate": 0.5}}, 256),
    # (Its largest captured size: sizes step by 8 to 256, then 16; 0.33.0 also captures
    # uniform decodes, n x (1 + k). Values from vLLM 0.33.0's own rule, by a review.)
    ({"max_num_seqs": 5, "speculative": {"method": "eagle", "num_speculative_tokens": 2,
                                         "acceptance_rate": 0.5}}, 24),
    ({"max_num_seqs": 50, "speculative": {"method": "eagle", "num_speculative_tokens": 2,
                                          "acceptance_rate": 0.5}}, 288),
    ({"max_num_seqs": 65, "speculative": {"method": "eagle", "num_speculative_tokens": 1,
                                          "acceptance_rate": 0.5}}, 256),
    ({"max_num_seqs": 7}, 8)])
def test_the_ranks_pad_up_to_vllms_capture_ceiling(scheduler, limit):
    """vLLM captures CUDA graphs up to min(2 x max_num_seqs x (1 + k), 512,
    max_num_batched_tokens) tokens, its largest captured size within that
    (`VllmConfig._set_cudagraph_sizes`): the ranks' steps are padded alike up to there, so a
    decode's drafts widen it."""
    cluster = Cluster(_scenario({"engine_version": "0.33.0", **scheduler}), fast_forward=False)
    (group,) = cluster.front
    assert group.pad_limit == limit
