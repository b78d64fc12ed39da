"""Model shapes read from Hugging Face config.json files: the committed ones against their
published sizes, KV bytes against hand computations, and the errors a bad file gives; a model's
context window (`max_model_len`) rejects requests beyond it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.hardware.gpus import GPUS
from sim.hardware.models import COMMITTED, DATA_DIR, MODELS, ModelShape, resolve_model
from tests.helpers import REPO, assert_one_line_error, run_cli


def test_every_committed_config_is_registered_and_parses() -> None:
    on_disk = {p.stem for p in DATA_DIR.glob("*.json")}
    assert on_disk == set(COMMITTED)
    assert (DATA_DIR / "SOURCES.md").is_file()
    for name, repo in COMMITTED.items():
        assert name in MODELS
        shape = MODELS.get(name)
        assert shape.name == name
        assert shape.source.startswith(f"{repo} config.json")
        assert shape.num_params > 0 and shape.kv_bytes_per_token > 0
        assert shape.max_model_len
        json.dumps(asdict(shape))  # the profiler writes it into its metadata
    assert set(MODELS.names()) == {*COMMITTED, "tiny"}
    assert list(MODELS) == MODELS.names()


def test_importing_reads_no_config() -> None:
    code = "import sim.hardware.models as m; print(sorted(m.MODELS._entries))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.strip() == "['tiny']"


# Published totals: model cards (Llama 2/3.1, Qwen2.5/3 cards; Mistral's and DeepSeek's
# announcements). Rounded to three significant figures, hence 1%.
PUBLISHED_TOTAL = {
    "llama-3-8b": 8.03e9,
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "llama-2-7b": 6.74e9,
    "llama-2-13b": 13.0e9,
    "llama-2-70b": 69.0e9,
    "mistral-7b": 7.24e9,
    "mixtral-8x7b": 46.7e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-32b": 32.8e9,  # the card says 32.5B; the weights hold 32.76B (within 1% of both)
    "qwen2.5-72b": 72.7e9,
    "qwen3-8b": 8.2e9,
    "qwen3-32b": 32.8e9,
    "qwen3-30b-a3b": 30.5e9,
    "deepseek-v2-lite": 15.7e9,
    # 671B: the main model's 61 layers, as `num_hidden_layers` counts them; the checkpoint's
    # multi-token-prediction layer (its 11.5B more make Hugging Face's 685B) is not among them.
    "deepseek-v3": 671e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL))
def test_total_parameters_match_the_published_figure(name: str) -> None:
    assert MODELS.get(name).num_params == pytest.approx(PUBLISHED_TOTAL[name], rel=0.01)


def test_dense_models_use_every_parameter() -> None:
    for name in COMMITTED:
        shape = MODELS.get(name)
        if not shape.is_moe:
            assert shape.num_active_params == shape.num_params
            assert shape.active_weight_bytes == shape.weight_bytes
            assert shape.num_dense_layers == shape.num_layers and shape.num_moe_layers == 0


def test_active_parameters_of_the_moe_models() -> None:
    mixtral = MODELS.get("mixtral-8x7b")
    assert mixtral.num_active_params == pytest.approx(12.9e9, rel=0.01)
    assert mixtral.active_weight_bytes == 2 * mixtral.num_active_params
    # Qwen publishes 3.3B: the count is 3.35B, and the figure has two significant digits.
    assert MODELS.get("qwen3-30b-a3b").num_active_params == pytest.approx(3.3e9, rel=0.02)
    # DeepSeek's 2.4B leaves the embedding table out (a lookup, not a matmul): 2.45B then.
    # num_active_params keeps it in, like Mistral's 12.9B for Mixtral: 2.66B.
    lite = MODELS.get("deepseek-v2-lite")
    embed = lite.vocab_size * lite.hidden_size
    assert lite.num_active_params - embed == pytest.approx(2.4e9, rel=0.025)
    assert lite.num_active_params == pytest.approx(2.66e9, rel=0.01)
    # DeepSeek-V3: "37B activated", 36.6B by its weights' documentation (README_WEIGHTS.md:
    # the LM head in, the embedding table out); 37.6B with the table.
    v3 = MODELS.get("deepseek-v3")
    embed = v3.vocab_size * v3.hidden_size
    assert v3.num_active_params - embed == pytest.approx(36.6e9, rel=0.01)
    assert v3.num_active_params == pytest.approx(37e9, rel=0.02)


def test_kv_bytes_per_token_by_hand() -> None:
    # GQA: K and V, layers x KV heads x head_dim x 2 bytes (bf16).
    assert MODELS.get("llama-3.1-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert MODELS.get("mixtral-8x7b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert MODELS.get("qwen3-30b-a3b").kv_bytes_per_token == 2 * 48 * 4 * 128 * 2 == 98_304
    assert MODELS.get("llama-2-7b").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    # MLA: the latent (kv_lora_rank) and the shared RoPE key, per layer, 2 bytes each.
    assert MODELS.get("deepseek-v2-lite").kv_bytes_per_token == 27 * (512 + 64) * 2 == 31_104
    assert MODELS.get("deepseek-v3").kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272


def test_moe_layouts() -> None:
    mixtral = MODELS.get("mixtral-8x7b")
    assert mixtral.moe_layer_indices == tuple(range(32)) and mixtral.num_dense_layers == 0
    assert (mixtral.num_experts, mixtral.num_experts_per_token) == (8, 2)
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size == 14336
    assert mixtral.expert_params == 3 * 4096 * 14336
    assert mixtral.router_params_per_layer == 4096 * 8
    qwen = MODELS.get("qwen3-30b-a3b")
    assert (qwen.num_experts, qwen.num_experts_per_token, qwen.moe_intermediate_size) \
        == (128, 8, 768)
    assert qwen.num_moe_layers == 48 and qwen.shared_expert_intermediate_size == 0
    lite = MODELS.get("deepseek-v2-lite")  # first_k_dense_replace = 1: layer 0 is dense
    assert lite.moe_layer_indices == tuple(range(1, 27)) and lite.num_dense_layers == 1
    assert lite.shared_expert_intermediate_size == 2 * 1408
    assert lite.shared_expert_params == 3 * 2048 * 2 * 1408
    assert lite.is_moe and lite.is_mla and not mixtral.is_mla
    v3 = MODELS.get("deepseek-v3")  # first_k_dense_replace = 3: layers 0-2 are dense
    assert v3.moe_layer_indices == tuple(range(3, 61)) and v3.num_dense_layers == 3
    assert (v3.num_experts, v3.num_experts_per_token, v3.moe_intermediate_size) \
        == (256, 8, 2048)
    assert v3.shared_expert_intermediate_size == 2048 and v3.intermediate_size == 18432
    assert not MODELS.get("llama-3-8b").is_moe


def test_mla_attention_by_hand() -> None:
    lite = MODELS.get("deepseek-v2-lite")
    h, heads = 2048, 16
    q_proj = h * heads * (128 + 64)  # no q_lora_rank: a plain q_proj
    kv_a = h * (512 + 64)  # kv_a_proj_with_mqa: the latent and the RoPE key
    kv_b = 512 * heads * (128 + 128)  # kv_b_proj: nope keys and values from the latent
    o_proj = heads * 128 * h
    assert lite.attn_params_per_layer == q_proj + kv_a + kv_b + o_proj == 13_762_560
    assert lite.attn_flops_per_pair_per_layer == 2 * heads * (128 + 64) + 2 * heads * 128
    assert lite.num_linear_params_per_layer == 13_762_560 + 3 * h * 10944
    v3 = MODELS.get("deepseek-v3")
    h, heads, r = 7168, 128, 1536
    q = h * r + r * heads * (128 + 64)  # q_a_proj and q_b_proj through q_lora_rank
    kv_a, kv_b = h * (512 + 64), 512 * heads * (128 + 128)
    assert v3.attn_params_per_layer == q + kv_a + kv_b + heads * 128 * h == 187_105_280
    assert v3.norm_params == (2 * 61 + 1) * h + 61 * (512 + r)


def test_deepseek_v3_is_an_fp8_checkpoint() -> None:
    # Its quantization_config (fp8, 128 x 128 blocks): the linear layers in one byte, the
    # embedding table, LM head, norms and routers in bf16.
    v3 = MODELS.get("deepseek-v3")
    assert v3.checkpoint_fp8 and v3.dtype_bytes == 2 and v3.max_model_len == 163_840
    fp8 = replace(v3, linear_dtype_bytes=1)
    kept = v3.embedding_params + v3.norm_params + 58 * 7168 * 256
    assert fp8.num_unquantized_params == kept
    assert fp8.weight_bytes == 2 * kept + (v3.num_params - kept)
    assert fp8.weight_bytes == pytest.approx(673e9, rel=0.001)


def test_gqa_attention_and_the_per_layer_meaning() -> None:
    llama = MODELS.get("llama-3.1-70b")
    assert llama.attn_flops_per_pair_per_layer == 4 * llama.q_size == 4 * 64 * 128
    assert llama.attn_params_per_layer == 8192 * (8192 + 2 * 1024) + 8192 * 8192
    assert llama.num_linear_params_per_layer \
        == llama.attn_params_per_layer + llama.dense_mlp_params_per_layer
    # An MoE model: attention plus a dense MLP, as one of its dense layers holds.
    qwen = MODELS.get("qwen3-30b-a3b")
    assert qwen.num_linear_params_per_layer == qwen.attn_params_per_layer + 3 * 2048 * 6144


def _config(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1376, "num_attention_heads": 8, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    base.update(fields)
    return base


def _write(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def test_a_path_to_a_config_json(tmp_path: Path) -> None:
    _write(tmp_path / "small" / "config.json", _config())
    shape = resolve_model("small/config.json", base_dir=tmp_path)
    assert shape.name == "small/config.json"
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, shape.intermediate_size, shape.vocab_size, shape.max_model_len) \
        == (4, 512, 8, 2, 64, 1376, 1000, 2048)
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    hand = ModelShape("x", 4, 512, 8, 2, 64, 1376, 1000)
    assert shape.num_params == hand.num_params
    # An absolute path, a directory holding config.json, and the same file read once.
    again = resolve_model(str(tmp_path / "small"))
    assert again.num_params == shape.num_params and again.name == str(tmp_path / "small")
    assert resolve_model("llama-3-8b") is MODELS.get("llama-3-8b")


def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    path = _write(tmp_path / "config.json", _config())
    assert resolve_model(str(path)).num_layers == 4
    _write(path, _config(num_hidden_layers=12))
    os.utime(path, ns=(1, 1))  # a different modification time, whatever the clock
    assert resolve_model(str(path)).num_layers == 12


def test_fields_and_defaults(tmp_path: Path) -> None:
    tied = resolve_model(str(_write(tmp_path / "a.json", _config(tie_word_embeddings=True))))
    untied = resolve_model(str(_write(tmp_path / "b.json", _config())))
    assert untied.num_params - tied.num_params == 1000 * 512
    fp32 = resolve_model(str(_write(tmp_path / "c.json", _config(torch_dtype="float32"))))
    assert fp32.dtype_bytes == 4 and fp32.weight_bytes == 4 * fp32.num_params
    assert resolve_model(str(_write(tmp_path / "d.json",
                                    _config(torch_dtype="float16")))).dtype_bytes == 2
    # Absent: no KV-head grouping (MHA), untied, bf16, no context limit; head_dim if given.
    bare = _config()
    for key in ("num_key_value_heads", "tie_word_embeddings", "torch_dtype",
                "max_position_embeddings"):
        del bare[key]
    shape = resolve_model(str(_write(tmp_path / "e.json", bare)))
    assert (shape.num_kv_heads, shape.tie_embeddings, shape.dtype_bytes, shape.max_model_len) \
        == (8, False, 2, None)
    assert resolve_model(str(_write(tmp_path / "f.json", _config(head_dim=32)))).head_dim == 32
    # No model_type: the architecture names the family.
    del bare["model_type"]
    assert resolve_model(str(_write(tmp_path / "g.json", bare))).num_layers == 4


def test_qwen_moe_sparse_steps_and_dense_layers(tmp_path: Path) -> None:
    config = _config(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     num_hidden_layers=8, num_experts=16, num_experts_per_tok=4,
                     moe_intermediate_size=256, decoder_sparse_step=2, mlp_only_layers=[3])
    shape = resolve_model(str(_write(tmp_path / "config.json", config)))
    assert shape.moe_layer_indices == (1, 5, 7)  # (i + 1) % 2 == 0, and not layer 3
    assert shape.num_dense_layers == 5
    per_moe = 512 * 16 + 16 * 3 * 512 * 256
    assert shape.num_params == 8 * shape.attn_params_per_layer + 5 * 3 * 512 * 1376 \
        + 3 * per_moe + 2 * 1000 * 512 + (2 * 8 + 1) * 512
    assert shape.num_params - shape.num_active_params == 3 * 12 * 3 * 512 * 256


@pytest.mark.parametrize(("content", "needle"), [
    ('{"hidden_size": 512,', "not JSON"),
    ("[1, 2]", "not a JSON object"),
])
def test_unreadable_files(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle):
        resolve_model(str(path))


@pytest.mark.parametrize(("fields", "needle"), [  # needle None: the file reads
    ({"num_hidden_layers": None}, "num_hidden_layers=<missing>: required"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True: must be an integer, not a boolean"),
    ({"hidden_size": 512.0}, "hidden_size=512.0: must be an integer, not a decimal number"),
    ({"vocab_size": "1000"}, "vocab_size='1000': must be an integer, not text"),
    ({"num_attention_heads": 0}, "num_attention_heads=0: must be at least 1"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3: must divide num_attention_heads"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1: must be true or false"),
    ({"torch_dtype": "int8"}, "torch_dtype='int8': must be one of"),
    # Present but falsy: refused, not taken for the default (bf16).
    ({"torch_dtype": False}, "torch_dtype=False: must be one of bfloat16, float16, float32"),
    ({"torch_dtype": ""}, "torch_dtype='': must be one of bfloat16, float16, float32"),
    ({"torch_dtype": 0}, "torch_dtype=0: must be one of bfloat16, float16, float32"),
    ({"torch_dtype": "bfloat16", "dtype": False}, None),  # torch_dtype is read first
    ({"model_type": "bert"}, "model_type='bert': not a decoder servesim models"),
    ({"quantization_config": {"quant_method": "awq"}},
     "quant_method 'awq': quantized checkpoints other than fp8"),
    # Sizes far past any published model's (per-layer loops ran for minutes on 10**9 layers).
    ({"num_hidden_layers": 10_001}, "num_hidden_layers=10001: must be at most 10,000"),
    ({"num_hidden_layers": 10_000}, None),
    ({"hidden_size": 2**20 + 1, "head_dim": 64},
     "hidden_size=1048577: must be at most 1,048,576"),
    ({"intermediate_size": 10**15}, "intermediate_size=1000000000000000: must be at most"),
    ({"num_attention_heads": 2**16 + 1}, "num_attention_heads=65537: must be at most 65,536"),
    ({"num_key_value_heads": 10**9}, "num_key_value_heads=1000000000: must be at most 65,536"),
    ({"head_dim": 10**9}, "head_dim=1000000000: must be at most 65,536"),
    ({"vocab_size": 2**24 + 1}, "vocab_size=16777217: must be at most 16,777,216"),
    ({"model_type": "mixtral", "num_local_experts": 10**9, "num_experts_per_tok": 2},
     "num_local_experts=1000000000: must be at most 65,536"),
    ({"model_type": "qwen3_moe", "num_experts": 10**9, "num_experts_per_tok": 2,
      "moe_intermediate_size": 64}, "num_experts=1000000000: must be at most 65,536"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 10**9}, "moe_intermediate_size=1000000000: must be at most"),
])
def test_bad_fields_are_named(tmp_path: Path, fields: dict[str, object],
                              needle: str | None) -> None:
    config = _config(**fields)
    config = {key: value for key, value in config.items() if value is not None}
    path = _write(tmp_path / "config.json", config)
    if needle is None:
        assert resolve_model(str(path)).dtype_bytes == 2
        return
    with pytest.raises(ValueError) as info:
        resolve_model(str(path))
    message = str(info.value)
    assert needle in message and str(path) in message and "\n" not in message


def test_bad_moe_fields_are_named(tmp_path: Path) -> None:
    config = _config(model_type="mixtral", num_local_experts=8, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok=9: more than the 8 experts"):
        resolve_model(str(_write(tmp_path / "a.json", config)))
    config = _config(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, mlp_only_layers=[9])
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[9\]: must hold layer indices"):
        resolve_model(str(_write(tmp_path / "b.json", config)))
    del config["moe_intermediate_size"]
    config["mlp_only_layers"] = []
    with pytest.raises(ValueError, match="moe_intermediate_size=<missing>: required"):
        resolve_model(str(_write(tmp_path / "c.json", config)))


def test_null_keeps_the_default_a_falsy_value_is_refused(tmp_path: Path) -> None:
    """JSON null means what an absent key means (bf16; no dense-only layers); false, 0, "" or
    {} are values, and wrong ones."""
    assert resolve_model(str(_write(tmp_path / "a.json", _config(torch_dtype=None)))) \
        .dtype_bytes == 2
    # A null torch_dtype leaves the newer `dtype` key to say it.
    assert resolve_model(str(_write(tmp_path / "b.json", _config(
        torch_dtype=None, dtype="float32")))).dtype_bytes == 4
    moe = _config(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64)
    for value in (None, []):
        shape = resolve_model(str(_write(tmp_path / "c.json", {**moe, "mlp_only_layers": value})))
        assert shape.num_moe_layers == 4
    for value, kind in ((False, "a boolean"), (0, "an integer"), ({}, "an object"),
                        ("", "text")):
        path = _write(tmp_path / "d.json", {**moe, "mlp_only_layers": value})
        with pytest.raises(ValueError) as info:
            resolve_model(str(path))
        assert str(info.value) == (f"{path}: mlp_only_layers={value!r}: must be a list of "
                                   f"layer indices, not {kind}")


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    text = json.dumps(_config(num_hidden_layers=32))
    path.write_text(text[:-1] + ', "num_hidden_layers": 1}')
    with pytest.raises(ValueError) as info:
        resolve_model(str(path))
    assert str(info.value) == (f"{path}: num_hidden_layers=32, then 1: given twice in one "
                               "object (JSON readers would silently keep the last)")
    # In a nested object too.
    path.write_text(text[:-1] + ', "rope_scaling": {"factor": 8.0, "factor": 2.0}}')
    with pytest.raises(ValueError, match="factor=8.0, then 2.0: given twice"):
        resolve_model(str(path))


@contextmanager
def _never_blocked(fifo: Path) -> Iterator[None]:
    """While inside: a named pipe that a reader opened and waits on is opened for writing and
    closed now and then, so a test reading it fails (on an empty file) rather than hangs."""
    done = threading.Event()

    def unblock() -> None:
        while not done.wait(0.5):
            with contextlib.suppress(OSError):  # ENXIO: no reader waiting
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_only_regular_files_of_bounded_size_are_read(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A device or a named pipe is refused before it is opened (reading /dev/zero would fill
    memory, a pipe with no writer blocks forever); a file past the cap before it is parsed."""
    import sim.hardware.hf_config

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with _never_blocked(fifo), pytest.raises(ValueError) as info:
        resolve_model(str(fifo))
    assert str(info.value) == f"{fifo}: not a regular file (a named pipe or a device)"
    # A pipe put where a regular file was, after it was looked at: opened without blocking and
    # refused, not read.
    with _never_blocked(fifo), pytest.raises(ValueError, match="not a regular file"):
        sim.hardware.hf_config._read_config(str(fifo), 0, 0)
    if Path("/dev/zero").exists():
        with pytest.raises(ValueError,
                           match=r"^/dev/zero: not a regular file \(a named pipe or a device\)$"):
            resolve_model("/dev/zero")
    monkeypatch.setattr(sim.hardware.hf_config, "MAX_CONFIG_BYTES", 1000)
    big = _write(tmp_path / "big.json", _config(padding="x" * 1000))
    size = big.stat().st_size
    with pytest.raises(ValueError) as info:
        resolve_model(str(big))
    assert str(info.value) == (f"{big}: too large for a config.json ({size} bytes; at most "
                               "1000 are read)")
    # What is read is capped as well: a file that grew since it was looked at.
    with pytest.raises(ValueError, match="too large for a config.json"):
        sim.hardware.hf_config._read_config(str(big), 0, 10)


SCENARIO_HEAD = ("name: snap\nworkload: {format: synthetic, num_requests: 2, arrivals: {qps: 1}, "
                 "lengths: {prompt: {dist: fixed, value: 10}, output: {dist: fixed, value: 2}}}\n")


@pytest.mark.parametrize(("content", "needle"), [
    (json.dumps(_config(torch_dtype=False)),
     "config.json: torch_dtype=False: must be one of bfloat16, float16, float32"),
    (json.dumps(_config(num_hidden_layers=32))[:-1] + ', "num_hidden_layers": 1}',
     "config.json: num_hidden_layers=32, then 1: given twice in one object"),
    (None, "config.json: not a regular file"),
    ("[" * 100_000, "config.json: not JSON (nested too deeply)"),
    ('{"vocab_size": ' + "1" * 5000 + "}", "config.json: an integer of 5000 digits (at most 30)"),
])
def test_bad_config_files_are_one_line_at_the_cli(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str],
                                                  content: str | None, needle: str) -> None:
    config = tmp_path / "config.json"
    if content is None:
        os.mkfifo(config)
    else:
        config.write_text(content)
    scenario = tmp_path / "run.yaml"
    scenario.write_text(SCENARIO_HEAD + "replica: {model: config.json}\n")
    with _never_blocked(config):
        code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario), "--out",
                            str(tmp_path / "out"))
    assert_one_line_error(code, err, f"{scenario}: replica.model=", f"{tmp_path}/{needle}")


def test_a_config_of_a_billion_layers_is_one_line_at_once(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """A committed config with `num_hidden_layers` set to 10**9 ran for minutes (fuzzing,
    2026-11-24: sizing the weights loops over the layers); so did a DeepSeek one's experts."""
    from tests.helpers import within

    for name, key, value, cap in (("llama-3.1-8b", "num_hidden_layers", 10**9, "10,000"),
                                  ("deepseek-v2-lite", "num_hidden_layers", 10**7, "10,000"),
                                  ("deepseek-v2-lite", "n_routed_experts", 10**9, "65,536")):
        config = json.loads((DATA_DIR / f"{name}.json").read_text())
        config[key] = value
        path = _write(tmp_path / name / "config.json", config)
        scenario = tmp_path / "run.yaml"
        scenario.write_text(SCENARIO_HEAD + f"replica: {{model: {path}}}\n")
        with within(60):  # a hang guard: unchecked, sizing the weights ran for minutes
            code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario), "--out",
                                str(tmp_path / "out"))
        assert_one_line_error(code, err, f"{scenario}: replica.model=",
                              f"{path}: {key}={value}: must be at most {cap}")


def test_a_snapshot_directory_in_a_scenario(tmp_path: Path) -> None:
    """`model:` naming a directory laid out as Hugging Face snapshots are (config.json beside
    the weights) reads its config.json; one without a config.json is one line at the field."""
    from sim.config.errors import InputError
    from sim.config.scenario import load_scenario

    snapshot = tmp_path / "models--acme--Tiny-6L" / "snapshots" / "abc123"
    _write(snapshot / "config.json", _config(num_hidden_layers=6))
    (snapshot / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "bare").mkdir()
    head = ("name: snap\nworkload: {format: synthetic, num_requests: 2, arrivals: {qps: 1}, "
            "lengths: {prompt: {dist: fixed, value: 10}, output: {dist: fixed, value: 2}}}\n")
    for model in ("models--acme--Tiny-6L/snapshots/abc123",
                  "models--acme--Tiny-6L/snapshots/abc123/"):
        scenario = tmp_path / "run.yaml"
        scenario.write_text(head + f"replica: {{model: {model}}}\n")
        replica = load_scenario(scenario).replica
        assert replica.model_shape.num_layers == 6
        # The config.json is the input (what a run hashes and names), not the weights.
        assert replica.model == snapshot / "config.json"
        assert replica.model_name == "acme/Tiny-6L"  # the repository, not the commit
    scenario.write_text(head + "replica: {model: bare/}\n")
    with pytest.raises(InputError) as exc:
        load_scenario(scenario)
    line = str(exc.value)
    assert "\n" not in line and line.startswith(f"{scenario}: replica.model=")
    assert f"{tmp_path / 'bare'}: a directory without a config.json" in line


def test_unknown_names_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'llama-9'; known: .*llama-3-8b"):
        resolve_model("llama-9")
    with pytest.raises(ValueError, match="file not found"):
        resolve_model("models/nothing.json", base_dir=tmp_path)
    with pytest.raises(ValueError, match="file not found"):
        resolve_model(str(tmp_path / "empty-dir-without-config"))
    with pytest.raises(KeyError, match="unknown model 'llama-9'"):
        MODELS.get("llama-9")


def test_model_shapes_have_the_published_sizes():
    assert MODELS.get("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert MODELS.get("llama-2-7b").num_params == pytest.approx(6.74e9, rel=0.01)
    assert MODELS.get("mistral-7b").num_params == pytest.approx(7.24e9, rel=0.01)
    assert MODELS.get("qwen3-8b").num_params == pytest.approx(8.2e9, rel=0.02)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB per token.
    assert MODELS.get("llama-3-8b").kv_bytes_per_token == 131072
    assert all(GPUS.get(name).source for name in GPUS)


def scenario(**replica) -> dict:
    return {
        "name": "limits",
        "workload": {"format": "synthetic", "num_requests": 3,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 7800},
                                 "output": {"dist": "fixed", "value": 500}}},
        "replica": {"scheduler": {"name": "prefill_first"}, **replica},
    }


def test_a_request_beyond_the_context_window_is_rejected_with_that_reason():
    res = run_scenario(parse_scenario(scenario(model="llama-3-8b"), "limits.yaml"))
    req = res.requests
    assert (req["status"] == "rejected").all()
    assert req["reason"].iloc[0] == ("max_model_len: prompt 7800 + output 500 tokens exceed "
                                     "max_model_len 8192")
    assert res.summary["requests"]["reasons"] == {"max_model_len": 3}
    # The same model with a longer window (or a replica override) serves them.
    for replica in ({"model": "llama-3.1-8b"}, {"model": "llama-3-8b", "max_model_len": 9000}):
        res = run_scenario(parse_scenario(scenario(**replica), "limits.yaml"))
        assert (res.requests["status"] == "finished").all()
