"""`profiler.measure.gemm_timing` times a layer's GEMMs in bf16 and fp8 (real torch, on the CPU
here; on a GPU in a session that has one), and `bench/gemm_vs_measured.py` compares them with the
roofline's GEMM model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from profiler.measure.gemm_timing import layer_gemms, measure, write
from sim.hardware.models import MODELS
from tests.helpers import REPO


def test_a_layers_gemms_at_the_shard_shape() -> None:
    # Llama-3.1-8B at TP2: 16 query heads and 4 KV heads of 128 per GPU; MLP 14336 / 2.
    assert layer_gemms(MODELS.get("llama-3.1-8b"), 2) == [
        ("attn_qkv", 4096, 16 * 128 + 2 * 4 * 128), ("attn_out", 16 * 128, 4096),
        ("mlp_gate_up", 4096, 2 * 7168), ("mlp_down", 7168, 4096)]


def test_timed_on_the_cpu_and_compared(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[profile]'")
    rows = measure("tiny", 1, "cpu", (1, 4), reps=2, warmup=1)
    assert len(rows) == 4 * 2 * 2  # four GEMMs, two token counts, two dtypes
    assert {r["dtype"] for r in rows} == {"bf16", "fp8"}
    assert all(r["time_s"] > 0 for r in rows)
    out = tmp_path / "gemm.csv"
    write(rows, out)
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from gemm_vs_measured import compare
    finally:
        sys.path.remove(str(REPO / "bench"))
    import csv

    with open(out, newline="") as f:
        lines = compare(list(csv.DictReader(f)), "h100-sxm")
    assert lines[0].startswith("note: measured on 'cpu")
    assert "bf16 (calibrated): predicted / measured" in lines
    assert "fp8 (extrapolated): predicted / measured" in lines
    assert sum(line.strip().startswith("8 GEMMs") for line in lines) == 2
