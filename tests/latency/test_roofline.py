"""The roofline latency model's physics: decode bound by memory bandwidth, prefill by compute,
faster memory making decode faster."""

from __future__ import annotations

import pytest

from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.latency import LATENCY_MODELS, BatchShape


def roofline(gpu: str = "h100-sxm", model: str = "llama-3-8b", **params):
    cls = LATENCY_MODELS.get("roofline")
    return cls(cls.Config(kind="roofline", **params), MODELS.get(model), GPUS.get(gpu))


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


def test_attention_layer_s_is_paid_once_per_layer_by_an_iteration_with_tokens():
    import numpy as np

    layers = MODELS.get("llama-3-8b").num_layers
    base, fixed = roofline(), roofline(attention_layer_s=1.0e-5)
    shapes = [BatchShape.decode_only(1, 10), BatchShape.decode_only(64, 64 * 3000)]
    for shape in shapes:
        assert fixed.iteration_time_s(shape) - base.iteration_time_s(shape) == pytest.approx(
            layers * 1.0e-5, rel=1e-9)
    # Element-wise on arrays: nothing paid where a row has no token.
    arrays = BatchShape.decode_only(np.array([0, 8]), np.array([0, 8000]))
    extra = fixed.iteration_time_s(arrays) - base.iteration_time_s(arrays)
    np.testing.assert_allclose(extra, [0.0, layers * 1.0e-5], atol=1e-15)
