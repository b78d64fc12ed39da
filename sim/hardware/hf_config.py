"""Reading a Hugging Face `config.json` into a `ModelShape`: the standard library only (no
transformers, no weights, no network); every error is one line naming the file and the field.
`sim.hardware.models` resolves names and paths to shapes through `read_config`."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from sim.config.input_file import FileProblem, loads, open_regular, stat_regular
from sim.hardware.shape import ModelShape

# A config.json is a few KB: the most read of one, with room to spare.
MAX_CONFIG_BYTES = 10 * 2**20


def read_config(path: Path) -> ModelShape:
    """The shape a config.json describes (named after the file), parsed once per version of the
    file (its resolved path, modification time and size). Anything but a regular file (a device,
    a named pipe) is refused before it is opened, and so is a file past MAX_CONFIG_BYTES; the
    JSON is read strictly (`sim.config.input_file.loads`: a key given twice, NaN, huge integers,
    deep nesting are refused)."""
    try:
        stat = stat_regular(path)
    except FileProblem as exc:
        raise ValueError(f"{path}: {exc}") from None
    if stat.st_size > MAX_CONFIG_BYTES:
        raise ValueError(_too_large(path, stat.st_size))
    return _read_config(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def _too_large(path: str | Path, size: int) -> str:
    return (f"{path}: too large for a config.json ({size} bytes; at most {MAX_CONFIG_BYTES} "
            "are read)")


@lru_cache(maxsize=64)
def _read_config(path: str, mtime_ns: int, size: int) -> ModelShape:
    try:
        # open_regular checks again once open: a file swapped for a named pipe since
        # `read_config` looked at it neither hangs the open nor is read.
        with open_regular(Path(path)) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:  # it grew since it was looked at
            raise ValueError(_too_large(path, len(raw)))
        data = loads(raw)
    except FileProblem as exc:
        raise ValueError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object but {type(data).__name__}")
    return _Config(data, path).shape(Path(path).stem)


# model_type -> (family, architecture class). Families: "dense", "mixtral", "qwen_moe" (Qwen2
# and Qwen3 MoE), "deepseek" (DeepSeek-V2/V3: MLA and MoE).
DECODERS: dict[str, tuple[str, str]] = {
    "llama": ("dense", "LlamaForCausalLM"),
    "mistral": ("dense", "MistralForCausalLM"),
    "qwen2": ("dense", "Qwen2ForCausalLM"),
    "qwen3": ("dense", "Qwen3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("deepseek", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("deepseek", "DeepseekV3ForCausalLM"),
}
_BY_ARCHITECTURE = {arch: model_type for model_type, (_, arch) in DECODERS.items()}
# `quantization_config.quant_method` of checkpoints whose linear layers hold fp8 weights, as
# vLLM's `fp8` and `fbgemm_fp8` methods load them (the rest stays in `torch_dtype`).
FP8_METHODS = ("fp8", "fbgemm_fp8")
# `torch_dtype` (or `dtype`, its newer name) -> bytes per weight; absent: bf16.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_MISSING = object()
# Upper bounds on the fields that size a model, far above any published decoder's (so that a
# slip, `"num_hidden_layers": 1000000000`, is one line rather than minutes in per-layer loops
# or sizes of petabytes). For comparison, the largest published: 126 layers, hidden 16,384 and
# MLP 53,248 (Llama-3.1-405B), 128 heads, head dim 256, vocabulary 262,144, 384 routed experts
# (Kimi K2), MLA ranks 1,536.
_LAYERS, _WIDTH, _HEADS, _VOCAB, _EXPERTS, _RANK = 10_000, 2**20, 2**16, 2**24, 2**16, 2**16
MAXIMA: dict[str, int] = {
    "num_hidden_layers": _LAYERS,
    "hidden_size": _WIDTH, "intermediate_size": _WIDTH, "moe_intermediate_size": _WIDTH,
    "shared_expert_intermediate_size": _WIDTH,
    "num_attention_heads": _HEADS, "num_key_value_heads": _HEADS, "head_dim": _HEADS,
    "vocab_size": _VOCAB,
    "num_local_experts": _EXPERTS, "num_experts": _EXPERTS, "n_routed_experts": _EXPERTS,
    "num_experts_per_tok": _EXPERTS, "n_shared_experts": _EXPERTS,
    "kv_lora_rank": _RANK, "q_lora_rank": _RANK, "qk_nope_head_dim": _RANK,
    "qk_rope_head_dim": _RANK, "v_head_dim": _RANK,
}


class _Config:
    """Typed reads of one parsed config.json; every error names the file and the field."""

    def __init__(self, data: dict[str, Any], path: str) -> None:
        self.data, self.path = data, path

    def fail(self, key: str, value: Any, problem: str) -> ValueError:
        shown = "<missing>" if value is _MISSING else repr(value)
        return ValueError(f"{self.path}: {key}={shown}: {problem}")

    def integer(self, key: str, default: Any = _MISSING, minimum: int = 1) -> Any:
        value = self.data.get(key, _MISSING)
        if value is None or value is _MISSING:
            if default is _MISSING:
                raise self.fail(key, value, "required (an integer)")
            return default
        if isinstance(value, bool):
            raise self.fail(key, value, "must be an integer, not a boolean")
        if not isinstance(value, int):
            raise self.fail(key, value, f"must be an integer, not {_kind(value)}")
        if value < minimum:
            raise self.fail(key, value, f"must be at least {minimum}")
        if key in MAXIMA and value > MAXIMA[key]:
            raise self.fail(key, value, f"must be at most {MAXIMA[key]:,} (well above any "
                                        "published model's)")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, value, f"must be true or false, not {_kind(value)}")
        return value

    def indices(self, key: str, num_layers: int) -> list[int]:
        value = self.data.get(key)
        if value is None:  # absent or null: none listed (as Qwen2MoeConfig reads it)
            return []
        if not isinstance(value, list):
            raise self.fail(key, value, f"must be a list of layer indices, not {_kind(value)}")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) \
                    or not 0 <= item < num_layers:
                raise self.fail(key, value, f"must hold layer indices 0..{num_layers - 1}")
        return value

    def model_type(self) -> str:
        model_type = self.data.get("model_type", _MISSING)
        if model_type is _MISSING:
            architectures = self.data.get("architectures", _MISSING)
            if architectures is _MISSING:
                raise self.fail("model_type", _MISSING, "required (or architectures)")
            if not isinstance(architectures, list) or not architectures:
                raise self.fail("architectures", architectures, "must be a non-empty list")
            if not isinstance(architectures[0], str) or architectures[0] not in _BY_ARCHITECTURE:
                raise self.fail("architectures", architectures,
                                f"not a decoder servesim models; known: "
                                f"{', '.join(_BY_ARCHITECTURE)}")
            return _BY_ARCHITECTURE[architectures[0]]
        if not isinstance(model_type, str) or model_type not in DECODERS:
            raise self.fail("model_type", model_type, f"not a decoder servesim models; known: "
                                                      f"{', '.join(DECODERS)}")
        return model_type

    def shape(self, name: str) -> ModelShape:
        family = DECODERS[self.model_type()][0]
        checkpoint_fp8 = fp8_blocks = False
        if "quantization_config" in self.data:
            config = self.data["quantization_config"]
            method = config.get("quant_method") if isinstance(config, dict) else None
            if method not in FP8_METHODS:
                raise ValueError(f"{self.path}: quantization_config: quant_method {method!r}: "
                                 f"quantized checkpoints other than fp8 ({', '.join(FP8_METHODS)}"
                                 ") are not modelled (their weights would be mis-sized)")
            checkpoint_fp8 = True
            # DeepSeek-style block scales, one per 128 x 128 tile (what vLLM's DeepEP paths
            # dispatch in fp8: `DEEPEP_QUANT_BLOCK_SHAPE`).
            fp8_blocks = config.get("weight_block_size") == [128, 128]
        layers = self.integer("num_hidden_layers")
        hidden = self.integer("hidden_size")
        heads = self.integer("num_attention_heads")
        if "head_dim" in self.data and self.data["head_dim"] is not None:
            head_dim = self.integer("head_dim")
        elif hidden % heads:
            raise self.fail("num_attention_heads", heads, f"does not divide hidden_size "
                                                          f"{hidden} (and no head_dim given)")
        else:
            head_dim = hidden // heads
        # `torch_dtype`, else `dtype` (its newer name); absent or null: bf16.
        dtype_key = "torch_dtype" if self.data.get("torch_dtype") is not None else "dtype"
        dtype = self.data.get(dtype_key)
        if dtype is None:
            dtype = "bfloat16"
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise self.fail(dtype_key, dtype, f"must be one of {', '.join(DTYPE_BYTES)}")
        fields: dict[str, Any] = {
            "name": name, "num_layers": layers, "hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": self.integer("num_key_value_heads", heads), "head_dim": head_dim,
            "intermediate_size": self.integer("intermediate_size"),
            "vocab_size": self.integer("vocab_size"),
            # False is the default of every family read here (LlamaConfig, MistralConfig,
            # MixtralConfig, Qwen2/3(Moe)Config, DeepseekV2/V3Config).
            "tie_embeddings": self.flag("tie_word_embeddings", False),
            "dtype_bytes": DTYPE_BYTES[dtype],
            "max_model_len": self.integer("max_position_embeddings", None),
            "source": self.path,
            "checkpoint_fp8": checkpoint_fp8, "fp8_block_scales": fp8_blocks,
        }
        if fields["num_kv_heads"] > heads or heads % fields["num_kv_heads"]:
            raise self.fail("num_key_value_heads", fields["num_kv_heads"],
                            f"must divide num_attention_heads ({heads})")
        if family == "mixtral":  # every layer MoE; `intermediate_size` is an expert's width
            fields.update(num_experts=self.integer("num_local_experts"),
                          num_experts_per_token=self.integer("num_experts_per_tok"),
                          moe_intermediate_size=fields["intermediate_size"])
        elif family == "qwen_moe":
            fields.update(self._qwen_moe(layers))
        elif family == "deepseek":
            fields.update(self._deepseek_moe(layers))
            fields.update(self._mla())
        if fields.get("num_experts_per_token", 0) > fields.get("num_experts", 0):
            raise self.fail("num_experts_per_tok", fields["num_experts_per_token"],
                            f"more than the {fields['num_experts']} experts")
        return ModelShape(**fields)

    def _qwen_moe(self, layers: int) -> dict[str, Any]:
        # Qwen2MoE/Qwen3MoE: layer i is MoE unless listed in mlp_only_layers, every
        # decoder_sparse_step-th layer ((i + 1) % step == 0).
        experts = self.integer("num_experts", 0, minimum=0)
        if not experts:
            return {}
        step = self.integer("decoder_sparse_step", 1)
        dense = set(self.indices("mlp_only_layers", layers))
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return {"num_experts": experts,
                "num_experts_per_token": self.integer("num_experts_per_tok"),
                "moe_intermediate_size": self.integer("moe_intermediate_size"),
                "shared_expert_intermediate_size":
                    self.integer("shared_expert_intermediate_size", 0, minimum=0),
                "moe_layers": None if len(moe) == layers else moe}

    def _deepseek_moe(self, layers: int) -> dict[str, Any]:
        # DeepSeek-V2/V3: layer i is MoE from first_k_dense_replace on, every moe_layer_freq-th.
        experts = self.integer("n_routed_experts", 0, minimum=0)
        if not experts:
            return {}
        first = self.integer("first_k_dense_replace", 0, minimum=0)
        freq = self.integer("moe_layer_freq", 1)
        moe = tuple(i for i in range(layers) if i >= first and i % freq == 0)
        width = self.integer("moe_intermediate_size")
        fields = {"num_experts": experts,
                  "num_experts_per_token": self.integer("num_experts_per_tok"),
                  "moe_intermediate_size": width,
                  "shared_expert_intermediate_size":
                      width * self.integer("n_shared_experts", 0, minimum=0),
                  "moe_layers": None if len(moe) == layers else moe}
        # Group-limited routing: V2's `group_limited_greedy`, V3's `noaux_tc` (vLLM's
        # `use_grouped_topk`); V2-Lite's `greedy` ignores its n_group.
        if self.data.get("topk_method") in ("group_limited_greedy", "noaux_tc"):
            groups = self.integer("n_group", 1)
            chosen = self.integer("topk_group", 1)
            if groups > 1:
                if experts % groups:
                    raise self.fail("n_group", groups, f"does not divide n_routed_experts "
                                                       f"({experts})")
                if chosen > groups:
                    raise self.fail("topk_group", chosen, f"more than n_group ({groups})")
                fields.update(num_expert_groups=groups, expert_groups_per_token=chosen)
        return fields

    def _mla(self) -> dict[str, Any]:
        return {"kv_lora_rank": self.integer("kv_lora_rank"),
                "q_lora_rank": self.integer("q_lora_rank", None),
                "qk_nope_head_dim": self.integer("qk_nope_head_dim"),
                "qk_rope_head_dim": self.integer("qk_rope_head_dim"),
                "v_head_dim": self.integer("v_head_dim")}


def _kind(value: Any) -> str:
    return {str: "text", float: "a decimal number", list: "a list", dict: "an object",
            bool: "a boolean", int: "an integer"}.get(
        type(value), type(value).__name__)
