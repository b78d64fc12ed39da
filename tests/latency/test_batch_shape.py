"""The shape of an iteration (`sim.latency.base.BatchShape`): from a plan (chunks, decodes,
sampled tokens, attention pairs) and from the counts a replica keeps, and the one rule a latency
model follows for the fast path: a call on arrays of shapes equals calls on each, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.request import Request
from sim.core.state import ReplicaState
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.latency import LATENCY_MODELS, BatchShape
from sim.schedulers.vllm_v1 import VllmV1, VllmV1Config
from tests.helpers import make_request


def test_the_shape_of_an_iteration_from_the_replicas_counts():
    """`BatchShape.of_replica` (the decodes' KV from the token count the replica keeps, less
    the prompts') against `from_plan` at every iteration of three policies stepping random
    requests through preemptions (few blocks) and queues (few seats): equal, and the count is
    used on batches that only decode and on batches with chunks beside decodes."""
    import numpy as np

    from sim.schedulers.chunked_prefill import ChunkedPrefill, ChunkedPrefillConfig
    from sim.schedulers.prefill_first import PrefillFirst, PrefillFirstConfig
    from sim.schedulers.sglang import SGLang, SGLangConfig

    rng = np.random.default_rng(3)
    used = mixed = 0
    for make in (lambda: ChunkedPrefill(ChunkedPrefillConfig(
                     name="chunked_prefill", token_budget=64, max_num_seqs=6)),
                 lambda: PrefillFirst(PrefillFirstConfig(name="prefill_first", max_num_seqs=6)),
                 lambda: SGLang(SGLangConfig(name="sglang", chunked_prefill_size=64,
                                             max_running_requests=6)),
                 lambda: VllmV1(VllmV1Config(name="vllm_v1", max_num_batched_tokens=64,
                                             max_num_seqs=6))):
        state = ReplicaState(KVCacheManager(num_blocks=int(rng.choice([24, 200])),
                                            block_size=4))
        for i in range(40):
            state.add(Request(i, 0.0, int(rng.integers(1, 60)), int(rng.integers(1, 30))))
        scheduler = make()
        # (Not `Stepper`: the shape is read between the plan and its commit.)
        for iteration in range(2000):
            if not (state.running or state.waiting):
                break
            plan = scheduler.schedule(state, float(iteration))
            shape = BatchShape.of_replica(plan, state)
            assert shape == BatchShape.from_plan(plan, state.requests)
            every = plan.num_seqs == len(state.running)
            used += every and shape.num_prefill_seqs == 0
            mixed += every and shape.num_prefill_seqs > 0 and shape.num_decode_tokens > 0
            state.commit(plan, iteration, float(iteration), iteration + 1.0)
            state.check()
        assert not (state.running or state.waiting)
    assert used > 100 and mixed > 30, (used, mixed)


def test_shape_from_plan_separates_chunks_and_decodes():
    decode = make_request(0, prompt=100, output=5, generated=2)  # 101 computed
    chunk = make_request(1, prompt=300, output=5)
    chunk.num_computed_tokens = 128
    final = make_request(2, prompt=40, output=5)
    plan = Plan({0: 1, 1: 64, 2: 40})
    shape = BatchShape.from_plan(plan, {0: decode, 1: chunk, 2: final})
    assert shape.num_prefill_tokens == 104
    assert (shape.num_decode_tokens, shape.num_prefill_seqs) == (1, 2)
    assert shape.num_sampled_tokens == 2  # the decode and the final chunk; not the middle chunk
    assert shape.decode_kv_tokens == 102
    assert shape.prefill_attn_pairs == 64 * 128 + 64 * 65 // 2 + 40 * 41 // 2
    assert shape.prefill_kv_tokens == 192 + 40


@pytest.mark.parametrize("kind", ["roofline", "constant"])
def test_stretch_prediction_equals_step_by_step(kind):
    """The engine predicts a decode stretch with one call on arrays of shapes: each entry must be
    what a call on that shape alone gives, bit for bit (the only fast-path rule a latency model
    follows)."""
    cls = LATENCY_MODELS.get(kind)
    model = cls(cls.Config(kind=kind), MODELS.get("mistral-7b"), GPUS.get("a100-80gb"))
    kv = 7000 + 7 * np.arange(50, dtype=np.int64)
    stretch = np.broadcast_to(model.iteration_time_s(BatchShape.decode_only(7, kv)), (50,))
    steps = [model.iteration_time_s(BatchShape.decode_only(7, 7000 + 7 * j)) for j in range(50)]
    assert stretch.tolist() == steps  # bit for bit
    assert np.all(np.diff(stretch) >= 0)
    mixed = BatchShape(num_prefill_tokens=np.array([0, 64, 512]), num_prefill_seqs=np.array(
        [0, 1, 2]), num_decode_tokens=np.array([3, 3, 0]), num_sampled_tokens=np.array([3, 4, 1]),
        prefill_attn_pairs=np.array([0, 64 * 65 // 2, 9000]),
        prefill_kv_tokens=np.array([0, 64, 600]), decode_kv_tokens=np.array([90, 93, 0]))
    each = [model.iteration_time_s(BatchShape(**{k: int(getattr(mixed, k)[i]) for k in (
        "num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens", "num_sampled_tokens",
        "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")})) for i in range(3)]
    assert np.broadcast_to(model.iteration_time_s(mixed), (3,)).tolist() == each
