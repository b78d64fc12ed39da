"""Latency models: roofline physics and the vectorised stretch path."""

from __future__ import annotations

import numpy as np
import pytest

from sim.core.plan import Plan
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.latency import LATENCY_MODELS, BatchShape
from tests.conftest import make_request


def roofline(gpu: str = "h100-sxm", model: str = "llama-3-8b", **params):
    cls = LATENCY_MODELS.get("roofline")
    return cls(cls.Config(kind="roofline", **params), MODELS.get(model), GPUS.get(gpu))


def test_model_shapes_have_the_published_sizes():
    assert MODELS.get("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert MODELS.get("llama-2-7b").num_params == pytest.approx(6.74e9, rel=0.01)
    assert MODELS.get("mistral-7b").num_params == pytest.approx(7.24e9, rel=0.01)
    assert MODELS.get("qwen3-8b").num_params == pytest.approx(8.2e9, rel=0.02)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB per token.
    assert MODELS.get("llama-3-8b").kv_bytes_per_token == 131072
    assert all(GPUS.get(name).source for name in GPUS)


def test_decode_is_bandwidth_bound_and_prefill_compute_bound():
    model = roofline(mbu=1.0, mfu=1.0, overhead_s=0.0, linear="naive",
                     elementwise="none")  # the datasheet's, GEMMs and attention alone
    shape = MODELS.get("llama-3-8b")
    # Every weight is read once, except the input embedding table (only the tokens' rows).
    weights_s = (shape.weight_bytes - shape.vocab_size * shape.hidden_size * 2) / 3.35e12
    one_decode = model.iteration_time_s(BatchShape.decode_only(1, 100))
    assert one_decode == pytest.approx(weights_s, rel=0.01)
    # Doubling a small decode batch barely costs anything; doubling a big prefill doubles it.
    assert model.iteration_time_s(BatchShape.decode_only(2, 200)) < 1.01 * one_decode
    big = BatchShape(num_prefill_tokens=8192, num_prefill_seqs=1, num_sampled_tokens=1,
                     prefill_attn_pairs=8192 * 8193 // 2, prefill_kv_tokens=8192)
    double = BatchShape(num_prefill_tokens=16384, num_prefill_seqs=2, num_sampled_tokens=2,
                        prefill_attn_pairs=8192 * 8193, prefill_kv_tokens=16384)
    assert model.iteration_time_s(double) == pytest.approx(2 * model.iteration_time_s(big),
                                                           rel=0.02)


def test_faster_memory_makes_decode_faster():
    shape = BatchShape.decode_only(32, 32 * 2000)
    h100, h200 = roofline("h100-sxm"), roofline("h200")
    a100 = roofline("a100-80gb")
    assert h200.iteration_time_s(shape) < h100.iteration_time_s(shape) < a100.iteration_time_s(
        shape)


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


