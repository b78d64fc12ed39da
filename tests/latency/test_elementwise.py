"""The elementwise kernel model (`sim.latency.elementwise`): bytes per token against a hand
count, its place in the roofline, extrapolation, the calibration file, and its error against
Vidur's public H100/A100 measurements (../shared/profiles/vidur, skipped where absent)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.hardware.parallelism import Parallelism
from sim.latency.base import BatchShape
from sim.latency.elementwise import (
    CALIBRATION_PATH,
    LAYER_OPS,
    OPS,
    ElementwiseModel,
    KernelParams,
    load_calibration,
    row_bytes,
)
from sim.latency.roofline import RooflineConfig, RooflineLatency
from tests.helpers import REPO

VIDUR = REPO.parent / "shared" / "profiles" / "vidur"
TOKENS = np.array([0, 1, 7, 64, 65, 512, 4096, 8192])


def test_row_bytes_by_hand() -> None:
    """Llama-3.1-8B (h 4096, 32 heads, 8 KV heads of 128, MLP 14,336, bf16): norms and the
    add read and write the whole hidden state on every GPU; rotary and activation split."""
    model = MODELS.get("llama-3.1-8b")
    one = row_bytes(model, Parallelism())
    two = row_bytes(model, Parallelism(tensor=2))
    assert one["input_layernorm"] == two["input_layernorm"] == (2 * 4096 * 2,) * 2
    assert one["add"] == two["add"] == (3 * 4096 * 2,) * 2
    assert one["emb"] == (2 * 4096 * 2,) * 2
    assert one["attn_rope"] == (2 * (32 + 8) * 128 * 2,) * 2
    assert two["attn_rope"] == (2 * (16 + 4) * 128 * 2,) * 2
    assert one["mlp_act"][0] == 3 * 14336 * 2 and two["mlp_act"][0] == 3 * 14336  # dense layers
    # TP16 leaves one KV head per GPU (replicated), not half of one.
    assert row_bytes(model, Parallelism(tensor=16))["attn_rope"][0] == 2 * (2 + 1) * 128 * 2
    # MoE: an MoE layer's activation is its k routed experts' widths (and shared experts').
    moe = MODELS.get("qwen3-30b-a3b")
    k, width = moe.num_experts_per_token, moe.moe_intermediate_size
    assert row_bytes(moe, Parallelism())["mlp_act"][1] == 3 * (k * width) * 2


def test_kernel_time_is_elementwise_and_zero_for_no_tokens() -> None:
    kernel = KernelParams(2e-6, 1e10, 2e12)
    got = kernel.time_s(TOKENS, 1000.0)
    assert got[0] == 0.0 and (np.diff(got[1:]) >= 0).all()
    assert got[1] == 2e-6 + 1000.0 / 1e10  # one row: its own streaming time
    assert got[-1] == 2e-6 + 1000.0 * 8192 / 2e12  # many rows: the aggregate bandwidth
    assert got.tolist() == [float(kernel.time_s(m, 1000.0)) for m in TOKENS.tolist()]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v2-lite"])
@pytest.mark.parametrize("tensor", [1, 2])
def test_roofline_adds_exactly_the_kernels(name: str, tensor: int) -> None:
    """`elementwise: calibrated` (the default) adds the kernels' time to the token term,
    nothing else; `none` leaves the roofline as it was."""
    model, gpu, split = MODELS.get(name), GPUS.get("h100-sxm"), Parallelism(tensor=tensor)
    shape = BatchShape(num_prefill_tokens=TOKENS, num_prefill_seqs=np.minimum(TOKENS, 1),
                       num_decode_tokens=np.zeros_like(TOKENS),
                       num_sampled_tokens=np.minimum(TOKENS, 1),
                       prefill_attn_pairs=TOKENS * (TOKENS + 1) // 2, prefill_kv_tokens=TOKENS)
    assert RooflineConfig(kind="roofline").elementwise == "calibrated"
    with_kernels = RooflineLatency(RooflineConfig(kind="roofline"), model, gpu, split)
    without = RooflineLatency(RooflineConfig(kind="roofline", elementwise="none"),
                              model, gpu, split)
    kernels = ElementwiseModel.for_gpu(gpu).iteration_s(TOKENS, model, split)
    got = with_kernels.iteration_time_s(shape) - without.iteration_time_s(shape)
    np.testing.assert_allclose(got, kernels, rtol=1e-12, atol=1e-15)
    assert kernels[0] == 0.0 and (kernels[1:] > 0).all()
    assert with_kernels.describe()["elementwise_form"] == "calibrated"
    assert "elementwise_form" not in without.describe()


def test_unmeasured_gpus_are_extrapolated_by_bandwidth() -> None:
    h100 = ElementwiseModel.for_gpu(GPUS.get("h100-sxm"))
    h200 = ElementwiseModel.for_gpu(GPUS.get("h200"))
    assert h100.form == "calibrated" and h200.form == "extrapolated"
    ratio = 4.8e12 / 3.35e12
    for op in OPS:
        assert h200.params[op].launch_s == h100.params[op].launch_s
        assert h200.params[op].bytes_s == pytest.approx(h100.params[op].bytes_s * ratio)
    assert "h100-sxm" in h200.describe()["elementwise_note"]


def test_calibration_file_is_checked(tmp_path: Path) -> None:
    fitted, source = load_calibration(CALIBRATION_PATH)
    assert {"h100-sxm", "a100-80gb"} <= set(fitted) and "vidur" in source.lower()
    data = json.loads(CALIBRATION_PATH.read_text())
    del data["gpus"]["h100-sxm"]["add"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="not a usable elementwise calibration.*add"):
        load_calibration(bad)
    data["gpus"]["h100-sxm"]["add"] = {"launch_s": 1e-6, "row_bytes_s": -1.0, "bytes_s": 1e12}
    bad.write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="out of range"):
        load_calibration(bad)


def test_fitted_kernels_against_the_measurements() -> None:
    """The committed parameters, against every measured row of 1-4096 tokens: the layer's five
    kernels together within 20% of 98% of rows on both GPUs and within 10% of 75% (as fitted:
    98.3% / 77.0% on the A100, 99.1% / 79.2% on the H100; each kernel alone is noisier at a
    few tokens, where launch costs vary by model); and leaving them out would miss 3-39% of a
    layer's measured token-proportional time."""
    if not (VIDUR / "compute").is_dir():
        pytest.skip(f"Vidur profiles not found at {VIDUR} (../shared/profiles/vidur)")
    from bench.calibrate_elementwise import load, predict

    data, _ = load(VIDUR)
    fitted, _ = load_calibration(CALIBRATION_PATH)
    assert set(data) == {"h100-sxm", "a100-80gb"}
    for gpu, cols in data.items():
        pred = sum(predict(fitted[gpu][op], cols["m"], cols[f"{op}_bytes"]) for op in LAYER_OPS)
        meas = sum(cols[f"{op}_s"] for op in LAYER_OPS)
        ratio = pred / meas
        assert np.mean(np.abs(ratio - 1) <= 0.2) >= 0.98, gpu
        assert np.mean(np.abs(ratio - 1) <= 0.1) >= 0.75, gpu
        assert ratio.min() > 0.7 and ratio.max() < 1.35, gpu
        share = meas / (meas + cols["gemm_s"])
        assert share.min() > 0.03 and share.max() < 0.4 and np.median(share) > 0.09, gpu
