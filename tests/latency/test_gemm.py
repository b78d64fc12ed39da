"""The GEMM time model (`sim.latency.gemm`): calibration file, exactness of arrays against
scalar calls, shape of the curve, and its error against Vidur's public H100/A100 measurements
(../shared/profiles/vidur, skipped where that folder is absent)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sim.hardware.gpus import GPUS, GPUSpec
from sim.latency.gemm import (
    CALIBRATION_PATH,
    REFERENCE_GPU,
    GemmModel,
    GemmParams,
    load_calibration,
)
from tests.helpers import REPO

VIDUR = REPO.parent / "shared" / "profiles" / "vidur"
MEASURED = ("h100-sxm", "a100-80gb")
# (k, n): Llama-2-7B's QKV and down projections, Llama-2-70B's gate+up at TP8, a tiny one, and
# a wide LM head.
SHAPES = [(4096, 12288), (11008, 4096), (8192, 7168), (512, 4096), (8192, 128256)]
CUSTOM = GPUSpec("custom-gpu", 400e12, 2e12, 48 * 2**30, "test")


def models() -> list[GemmModel]:
    out = [GemmModel.for_gpu(GPUS.get(name)) for name in GPUS.names()]
    out += [GemmModel.for_gpu(GPUS.get(name), correction=False) for name in MEASURED]
    out += [GemmModel.for_gpu(CUSTOM), GemmModel.for_gpu(GPUS.get("h100-sxm"), calibrated=False)]
    return out


def test_calibration_file_has_every_measured_gpu() -> None:
    data = load_calibration(CALIBRATION_PATH)
    assert data["source"]["vidur_commit"] == "7d47513363ec447a741ac5e47241580b47724fbf"
    assert set(MEASURED) <= set(data["gpus"]) and data["reference_gpu"] == REFERENCE_GPU
    for name in MEASURED:
        entry = data["gpus"][name]
        model = GemmModel.for_gpu(GPUS.get(name))
        assert model.form == "calibrated" and not model.extrapolated
        p = model.params
        assert 0 < p.launch_s < 50e-6 and 0 <= p.overlap <= 4 and p.m_tile == 64
        spec = GPUS.get(name)
        # Physical: no more than the datasheet's FLOP/s and bandwidth, and not far below.
        assert 0.5 * spec.peak_bf16_flops < p.flops_s <= spec.peak_bf16_flops
        assert 0.5 * spec.memory_bandwidth_bytes_s < p.bytes_s <= spec.memory_bandwidth_bytes_s
        assert entry["fit"]["rows"] > 1000 and entry["fit"]["median_abs_error"] < 0.06
        # The efficiency correction: knots 1..4096 tokens, factors near 1 (a correction, not a
        # second model), and what for_gpu applies by default.
        assert model.correction is not None
        knots, factors = model.correction
        assert knots[0] == 1 and knots[-1] == 4096 and len(knots) == len(factors) > 100
        assert list(knots) == entry["correction"]["knots"]
        assert min(factors) > 0.8 and max(factors) < 1.25
        assert GemmModel.for_gpu(spec, correction=False).correction is None
        assert model.efficiency_factor(1e6) == factors[-1]  # constant beyond the last knot
        assert model.efficiency_factor(0.5) == factors[0]


def test_other_gpus_are_extrapolated_from_the_h100_by_datasheet_ratios() -> None:
    h100 = GemmModel.for_gpu(GPUS.get("h100-sxm")).params
    for spec in [GPUS.get("h200"), CUSTOM]:
        model = GemmModel.for_gpu(spec)
        assert model.extrapolated and "extrapolated" in model.describe()["gemm_source"]
        p = model.params
        assert p.flops_s == pytest.approx(
            h100.flops_s * spec.peak_bf16_flops / GPUS.get("h100-sxm").peak_bf16_flops)
        assert p.bytes_s == pytest.approx(
            h100.bytes_s * spec.memory_bandwidth_bytes_s
            / GPUS.get("h100-sxm").memory_bandwidth_bytes_s)
        assert (p.launch_s, p.overlap, p.m_tile) == (h100.launch_s, h100.overlap, h100.m_tile)
        # The H100's efficiency correction is not carried over: extrapolated GPUs get the smooth
        # form alone.
        assert model.correction is None and model.describe()["gemm_correction"] == "none"
    # The H200 has the H100's math and more bandwidth: never slower than the H100's smooth form,
    # faster where memory-bound.
    h200 = GemmModel.for_gpu(GPUS.get("h200"))
    h100m = GemmModel.for_gpu(GPUS.get("h100-sxm"), correction=False)
    m = np.arange(1, 8193)
    assert np.all(h200.time_s(m, 8192, 8192) <= h100m.time_s(m, 8192, 8192))
    assert h200.time_s(1, 8192, 8192) < 0.8 * h100m.time_s(1, 8192, 8192)


def test_arrays_equal_scalar_calls_bit_for_bit() -> None:
    m_int: np.ndarray = np.r_[np.arange(0, 300), np.arange(300, 20000, 97), [2**20 - 1, 2**20]]
    # fractions: MoE's expected tokens per expert
    m_float: np.ndarray = np.r_[0.0, 0.25, 0.5, 63.5, 64.0, 64.001, 127.9, 1000.3]
    for model in models():
        for k, n in SHAPES[:3]:
            for m in (m_int, m_float):
                arr = model.time_s(m, k, n)
                assert arr.dtype == np.float64 and arr.shape == m.shape
                scalars = np.array([model.time_s(v.item(), k, n) for v in m])
                assert np.array_equal(arr, scalars), (model.gpu, model.form, k, n)
                assert all(isinstance(model.time_s(v, k, n), float) for v in m[:3])
        # long arrays (evaluated in chunks) and 2-D arrays: the same floats again
        long = np.arange(12289)
        arr = model.time_s(long, 4096, 12288)
        idx = np.r_[np.arange(0, 12289, 37), 4095, 4096, 4097, 8191, 8192, 12288]
        assert np.array_equal(arr[idx], [model.time_s(int(i), 4096, 12288) for i in idx])
        grid = model.time_s(long[:12288].reshape(3, 4096), 4096, 12288)
        assert grid.shape == (3, 4096) and np.array_equal(grid.ravel(), arr[:12288])
        # numpy scalars and other integer dtypes give the same floats
        assert model.time_s(np.int32(77), 4096, 4096) == model.time_s(77, 4096, 4096)
        assert np.array_equal(model.time_s(np.arange(50, dtype=np.int32), 4096, 4096),
                              model.time_s(np.arange(50), 4096, 4096))


def test_zero_tokens_take_no_time() -> None:
    for model in models():
        for k, n in SHAPES:
            assert model.time_s(0, k, n) == 0.0
            assert model.time_s(np.zeros(3, dtype=np.int64), k, n).tolist() == [0.0] * 3
            assert model.time_s(1, k, n) > 0
        assert model.time_s(5, 0, 4096) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        models()[0].time_s(np.array([3, -1]), 4096, 4096)
    with pytest.raises(ValueError):
        models()[0].time_s(float("nan"), 4096, 4096)


def test_time_is_non_decreasing_in_tokens() -> None:
    """The smooth form (no correction) is non-decreasing over 1..16384 tokens, with steps at
    whole tiles of 64 rows (the form has no wave steps); large batches approach the fitted
    FLOP/s. With the correction the time is the smooth form's times the GPU's factor."""
    m = np.arange(1, 16385)
    for model in models():
        smooth = GemmModel(model.params, model.gpu, model.form)
        for k, n in SHAPES:
            t = smooth.time_s(m, k, n)
            assert np.all(np.diff(t) >= 0), (model.gpu, model.form, k, n)
            if model.correction is None:
                assert np.array_equal(model.time_s(m, k, n), t)
            else:
                ratio = model.time_s(m, k, n) / t
                assert np.allclose(ratio, model.efficiency_factor(m), rtol=1e-12)
        if model.form != "naive":
            k, n = 8192, 28672
            big = model.time_s(16384, k, n)
            assert 2 * 16384 * k * n / big == pytest.approx(model.params.flops_s, rel=0.1)


def test_vectorised_evaluation_is_cheap() -> None:
    """A 16,385-entry table for one shape is a handful of numpy passes (timed in
    bench/calibrate_gemm.py's report, not here); check it gives one float per token count."""
    t = GemmModel.for_gpu(GPUS.get("h100-sxm")).time_s(np.arange(16385), 4096, 12288)
    assert t.shape == (16385,) and t[0] == 0.0 and np.all(np.isfinite(t))


def test_params_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        GemmParams(1e-6, 1e14, 1e12, 5.0)
    with pytest.raises(ValueError):
        GemmParams(1e-6, 0.0, 1e12, 1.0)


def test_a_broken_calibration_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "gemm.json"
    bad.write_text(json.dumps({"gpus": {"h100-sxm": {"params": {"launch_s": 1e-6}}}}))
    with pytest.raises(RuntimeError, match="gemm.json"):
        load_calibration(bad)


# --- against the measurements -------------------------------------------------------------


@pytest.fixture(scope="module")
def measured():  # type: ignore[no-untyped-def]
    if not (VIDUR / "compute").is_dir():
        pytest.skip(f"Vidur profiles not found at {VIDUR} (../shared/profiles/vidur)")
    from bench.calibrate_gemm import OPS, load_rows, predict

    rows = load_rows(VIDUR)
    assert len(OPS) == 4 and set(rows.gpu.tolist()) == set(MEASURED)
    out = {}
    for gpu in MEASURED:
        sub = rows.select(rows.gpu == gpu)
        spec = GPUS.get(gpu)
        meas = sub.median_s.sum(axis=1)
        after = predict(GemmModel.for_gpu(spec), sub)
        before = predict(GemmModel.for_gpu(spec, calibrated=False), sub)
        out[gpu] = (sub, after.sum(axis=1) / meas, before.sum(axis=1) / meas, after)
    return out


def test_measurement_shapes_are_what_the_gemms_compute(measured) -> None:  # type: ignore[no-untyped-def]
    """The (m, k, n) worked out from the shape columns: at 4096 tokens a GEMM's time is about
    proportional to its FLOPs (within the 2x that kernel efficiencies differ by), and halving a
    shard (TP 1 -> 2 -> 4 -> 8) about halves it."""
    for gpu, (rows, *_rest) in measured.items():
        big = rows.m == 4096
        flops = 2 * rows.m[big, None] * rows.kn[big, :, 0] * rows.kn[big, :, 1]
        rate = flops / rows.median_s[big]
        assert rate.max() / rate.min() < 2.5, gpu
        for model in set(rows.model.tolist()):
            sel = big & (rows.model == model)
            by_tp = {int(tp): rows.median_s[sel & (rows.tp == tp)][0] for tp in (1, 2, 4, 8)}
            for lo, hi in ((1, 2), (2, 4), (4, 8)):
                ratio = by_tp[lo] / by_tp[hi]
                assert np.all((ratio > 1.5) & (ratio < 2.6)), (gpu, model, lo, ratio)


def test_calibrated_linear_layers_against_measurements(measured) -> None:  # type: ignore[no-untyped-def]
    """The four-GEMM sum of a layer, every row with 1-4096 tokens of every model and TP degree.

    What holds (the default model, with the efficiency correction): the calibrated error is far
    below the naive roofline's (which is off by up to 3x); 95.6% of A100 and 90.8% of H100 rows
    are within 10% (93.8% and 82.7% with the smooth form alone); every row is within 22% (A100)
    and 40% (H100); each series' median is within 5%. The 10%-on-every-row target does not hold:
    the misses are particular shapes at particular token counts (e.g. Llama-2-7B at TP8 and one
    token, 1.39), which one factor of tokens shared by every shape of a GPU cannot follow."""
    data = load_calibration(CALIBRATION_PATH)["gpus"]
    limits = {"a100-80gb": (0.95, 0.22), "h100-sxm": (0.90, 0.40)}  # within 10%, worst
    for gpu, (rows, after, before, _) in measured.items():
        err_after = np.abs(np.log(after))
        err_before = np.abs(np.log(before))
        assert err_after.max() < 0.5 * err_before.max(), gpu
        assert np.mean(np.abs(after - 1) <= 0.1) > np.mean(np.abs(before - 1) <= 0.1) + 0.3
        within, worst = limits[gpu]
        assert np.mean(np.abs(after - 1) <= 0.1) >= within, gpu
        assert np.abs(after - 1).max() <= worst, gpu
        for model in set(rows.model.tolist()):
            for tp in (1, 2, 4, 8):
                sel = (rows.model == model) & (rows.tp == tp)
                assert abs(np.median(after[sel]) - 1) < 0.05, (gpu, model, tp)
        # The file's figures are those of the committed parameters on these measurements.
        fit = data[gpu]["fit"]
        assert fit["rows"] == len(after)
        assert fit["max_abs_error"] == pytest.approx(np.abs(after - 1).max(), rel=1e-9)
        assert fit["rows_within_10pct"] == pytest.approx(np.mean(np.abs(after - 1) <= 0.1))


@pytest.mark.slow
def test_correction_generalises_to_a_left_out_model(measured) -> None:  # type: ignore[no-untyped-def]
    """The correction fitted on all models of a GPU but one, tested on the one left out, for
    each model: still better than the smooth form alone on rows within 10% (H100 88.6% held out
    against 82.7% smooth and 90.8% in-sample; A100 94.3% against 93.8% and 95.6%), the worst
    row within 45% (H100, Llama-2-7B TP8 at one token) and 23% (A100)."""
    from bench.calibrate_gemm import leave_one_model_out, predict

    data = load_calibration(CALIBRATION_PATH)["gpus"]
    limits = {"a100-80gb": (0.94, 0.23), "h100-sxm": (0.88, 0.45)}  # within 10%, worst
    for gpu, (rows, after, _, _) in measured.items():
        model = GemmModel.for_gpu(GPUS.get(gpu), correction=False)
        smooth = predict(model, rows).sum(axis=1) / rows.median_s.sum(axis=1)
        held = leave_one_model_out(gpu, model.params, rows)
        within = np.mean(np.abs(held - 1) <= 0.1)
        assert within > np.mean(np.abs(smooth - 1) <= 0.1), gpu
        assert within >= limits[gpu][0] and np.abs(held - 1).max() <= limits[gpu][1], gpu
        assert within <= np.mean(np.abs(after - 1) <= 0.1), gpu
        assert data[gpu]["fit_leave_one_model_out"]["rows_within_10pct"] == pytest.approx(within)


def test_no_monotone_model_meets_ten_percent_everywhere(measured) -> None:  # type: ignore[no-untyped-def]
    """Why every row within 10% is out of reach, computed: the best max error any
    non-decreasing curve in tokens can reach, per GPU, model and TP degree, exceeds 10% for
    several series."""
    from bench.calibrate_gemm import monotone_bound

    over = 0
    for rows, *_rest in measured.values():
        meas = rows.median_s.sum(axis=1)
        for model in set(rows.model.tolist()):
            for tp in (1, 2, 4, 8):
                sel = (rows.model == model) & (rows.tp == tp)
                over += monotone_bound(rows.m[sel], meas[sel]) > 0.1
    assert over == 11
