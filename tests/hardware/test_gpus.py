"""GPU figures (sources, interconnect, price), custom GPUs from a scenario mapping, and the tables
of `servesim list`."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from sim.config.errors import InputError
from sim.hardware.gpus import GPUS, GPUSpec, GPUSpecInput, resolve_gpu
from sim.hardware.models import MODELS
from tests.helpers import cli_code, imported_by
from tests.helpers import run_cli_out as cli

GiB = 2**30

CUSTOM = {"name": "my-gpu", "peak_bf16_flops": 4.0e14, "memory_bandwidth_bytes_s": 2.0e12,
          "memory_bytes": 4.8e10, "interconnect_bandwidth_bytes_s": 6.4e10,
          "cost_per_gpu_hour": 1.5}


@pytest.mark.parametrize("name", GPUS.names())
def test_every_gpu_has_sources_a_link_and_a_price(name):
    gpu = GPUS.get(name)
    assert gpu.name == name
    assert gpu.source and gpu.cost_source
    assert gpu.interconnect
    for figure in (gpu.peak_bf16_flops, gpu.memory_bandwidth_bytes_s, gpu.memory_bytes,
                   gpu.interconnect_bandwidth_bytes_s, gpu.cost_per_gpu_hour):
        assert figure is not None and math.isfinite(figure) and figure > 0
    # Whole GiB, as the datasheets' "80GB" / "141GB" are.
    assert gpu.memory_bytes % GiB == 0


def test_the_new_gpus_are_registered():
    assert {"a100-80gb", "h100-sxm", "h200", "l40s", "a10g", "b200", "mi300x"} <= set(GPUS)


def test_memory_is_in_exact_binary_units():
    assert GPUS.get("h100-sxm").memory_bytes == 80 * GiB == 85_899_345_920
    assert GPUS.get("a100-80gb").memory_bytes == 80 * GiB
    # More than torch's ~140 GiB of an H200, which 141e9 bytes (131.3 GiB) was not.
    assert GPUS.get("h200").memory_bytes == 141 * GiB
    assert GPUS.get("mi300x").memory_bytes == 192 * GiB


def test_datasheet_figures():
    h100, a100 = GPUS.get("h100-sxm"), GPUS.get("a100-80gb")
    assert (h100.peak_bf16_flops, h100.memory_bandwidth_bytes_s) == (989.4e12, 3.35e12)
    assert (a100.peak_bf16_flops, a100.memory_bandwidth_bytes_s) == (312e12, 2.039e12)
    assert GPUS.get("h200").memory_bandwidth_bytes_s == 4.8e12
    # NVLink 4 is "900 GB/s" both ways together; the field is one direction.
    assert h100.interconnect_bandwidth_bytes_s == 450e9
    assert GPUS.get("l40s").interconnect == "pcie4"


def test_five_positional_fields_still_make_a_spec():
    gpu = GPUSpec("x", 1e14, 1e12, 16 * GiB, "test")
    assert gpu.interconnect_bandwidth_bytes_s > 0
    assert gpu.cost_per_gpu_hour is None


def test_a_custom_mapping_becomes_a_spec():
    gpu = resolve_gpu(CUSTOM)
    assert gpu == GPUSpec("my-gpu", 4.0e14, 2.0e12, 4.8e10, "custom GPU given in the scenario",
                          6.4e10, "custom", 1.5, "given in the scenario")
    assert GPUSpecInput.model_validate(CUSTOM).to_spec() == gpu
    # Integers are numbers too; the price and the sources are optional.
    plain = {k: v for k, v in CUSTOM.items() if k != "cost_per_gpu_hour"}
    gpu = resolve_gpu({**plain, "memory_bytes": 48 * GiB, "source": "my datasheet"})
    assert (gpu.memory_bytes, gpu.source, gpu.cost_per_gpu_hour) == (48 * GiB, "my datasheet", None)


def test_a_name_resolves_to_the_registered_spec():
    assert resolve_gpu("h200") is GPUS.get("h200")


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("peak_bf16_flops", True, "must be a number, not a boolean"),
    ("memory_bytes", "4.8e10", "must be a number, not text"),
    ("memory_bandwidth_bytes_s", -2.0e12, "greater than or equal to 10000000000"),
    ("memory_bandwidth_bytes_s", 3.35, "greater than or equal to"),  # TB/s written as 3.35
    ("memory_bytes", 80, "greater than or equal to 1073741824"),  # GiB written as 80
    ("interconnect_bandwidth_bytes_s", float("nan"), "must be a finite number"),
    ("cost_per_gpu_hour", 0, "greater than 0"),
    ("peak_bf16_flops", 4.0e20, "less than or equal to"),  # a unit slip
])
def test_a_bad_figure_is_refused_at_its_field(field, value, problem):
    with pytest.raises(ValueError) as info:
        resolve_gpu({**CUSTOM, field: value})
    assert isinstance(info.value, ValidationError)
    err = InputError.from_validation("s.yaml", info.value)
    assert err.field == field
    assert problem in err.problem


@pytest.mark.parametrize(("value", "field", "needle"), [
    ({k: v for k, v in CUSTOM.items() if k != "memory_bytes"}, "memory_bytes", "required"),
    ({**CUSTOM, "flops": 1.0}, "flops", "Extra inputs"),
    ({**CUSTOM, "name": "h100-sxm"}, "name", "registered GPU"),
    ({**CUSTOM, "name": ""}, "name", "pattern"),
])
def test_a_bad_mapping_names_its_field(value, field, needle):
    with pytest.raises(ValidationError) as info:
        resolve_gpu(value)
    err = InputError.from_validation("s.yaml", info.value)
    assert err.field == field
    assert needle in err.problem


@pytest.mark.parametrize(("value", "needle"), [
    ("h100", "unknown gpu 'h100'; known: a100-80gb"),
    (80, "registered name"),
    (None, "registered name"),
])
def test_neither_a_known_name_nor_a_mapping(value, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_gpu(value)


def test_the_custom_gpu_is_frozen():
    spec = GPUSpecInput.model_validate(CUSTOM)
    with pytest.raises(ValidationError):
        spec.name = "other"  # type: ignore[misc]


def test_list_shows_every_gpu_and_model(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    code, out = cli(monkeypatch, capsys, "list")
    assert code == 0
    for name in (*GPUS.names(), *MODELS.names()):
        assert name in out
    for text in ("GPUs", "models", "TFLOP/s", "nvlink4", "infinity-fabric", "6.88", "131,072"):
        assert text in out
    assert "every scheduler" not in out


def test_list_params(monkeypatch, capsys):
    code, out = cli(monkeypatch, capsys, "list", "--params")
    assert code == 0
    for text in ("every scheduler", "max_num_seqs", "latency model roofline", "mfu",
                 "router prefix_affinity", "cache_threshold"):
        assert text in out


def test_help_imports_no_gpu_figures_and_no_pydantic():
    """sim.hardware.gpus imports pydantic (for GPUSpecInput): it stays off the top-level help's
    path."""
    assert imported_by(cli_code("--help"), ("sim.hardware.gpus", "pydantic")) == []


def test_rtx_parts_use_their_fp32_accumulate_rates_and_match_torchs_names():
    from sim.hardware.gpus import measured_on

    rtx4090, pro = GPUS.get("rtx4090"), GPUS.get("rtxpro6000")
    # A GeForce part runs bf16 with fp32 accumulation (what GEMMs use) at half its fp16 rate.
    assert rtx4090.peak_bf16_flops == 165.2e12 and rtx4090.peak_fp8_flops == 330.3e12
    assert pro.peak_bf16_flops == 503.8e12 and pro.memory_bandwidth_bytes_s == 1792e9
    assert rtx4090.interconnect == "pcie4" and pro.interconnect == "pcie5"
    # Torch's device names space their words; the registered names do not.
    assert measured_on("rtx4090", "NVIDIA GeForce RTX 4090")
    assert measured_on("rtxpro6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert not measured_on("rtx4090", "NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert measured_on("h100-sxm", "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("name", GPUS.names())
def test_every_gpu_can_be_the_base_of_a_custom_one(name):
    """A scenario's `gpu: {base: NAME, ...}` takes every registered GPU's figures and texts
    (a source longer than a custom GPU's field may hold refused one)."""
    spec = resolve_gpu({"base": name, "name": "mine", "cost_per_gpu_hour": 1.0})
    assert spec.memory_bytes == GPUS.get(name).memory_bytes
