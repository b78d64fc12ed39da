"""Decoder model shapes: dense (Llama, Mistral, Qwen2/3), MoE (Mixtral, Qwen-MoE, DeepSeek) and
DeepSeek's multi-head latent attention (MLA); SwiGLU MLPs and RMSNorm throughout.

Shared by the roofline model, the KV sizing and the profiler, which builds the same model with
random weights. A model is a registered name (`MODELS`: the Hugging Face `config.json` files
committed under `sim/data/models/`, read on first use, plus `tiny`, a hand-made CPU test model)
or the path to a `config.json` (`resolve_model`). Only the standard library reads the files: no
transformers, no weights, no network.

Parameter counts are those of the weight matrices, the embedding table, the LM head (unless
tied) and the RMSNorm vectors. Biases (Qwen2's q/k/v), Qwen3's per-head q/k norms and routers'
bias terms are left out: under 0.01% of any model here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from sim.input_file import FileProblem, loads, open_regular, stat_regular
from sim.registry import Registry

DATA_DIR = Path(__file__).parent / "data" / "models"
# A config.json is a few KB: the most read of one, with room to spare.
MAX_CONFIG_BYTES = 10 * 2**20

# The committed config.json files, by registered name: `sim/data/models/<name>.json`, copied
# from the Hugging Face repository named here (sources and licences: SOURCES.md there).
COMMITTED: dict[str, str] = {
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    # Llama-3.1: the same shape with a 128k context (RoPE scaling), for long-context traces.
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
}
# Written from the published values rather than copied (no copy of the file was found).
RECONSTRUCTED = frozenset({"llama-3.1-70b", "qwen2.5-72b", "deepseek-v2-lite"})


@dataclass(frozen=True)
class ModelShape:
    """One decoder's shape.

    Dense layers use `intermediate_size`; MoE layers (`moe_layer_indices`) a router, `num_experts`
    routed experts of `moe_intermediate_size` each (`num_experts_per_token` of them per token)
    and shared experts `shared_expert_intermediate_size` wide in all (0: none).

    MLA (`kv_lora_rank` > 0): queries come from `q_proj` (or `q_a_proj`/`q_b_proj` through
    `q_lora_rank`), keys and values from a compressed latent of `kv_lora_rank` plus a shared RoPE
    key of `qk_rope_head_dim`; `head_dim`, `q_size` and `kv_size` then describe no real tensor.
    KV bytes per token are those of the latent vLLM caches, `num_layers * (kv_lora_rank +
    qk_rope_head_dim) * dtype_bytes`: an approximation that ignores the layout padding of some
    attention backends and FP8 KV caches.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2  # bf16
    # Context window, prompt plus output (`max_position_embeddings`, vLLM's default max_model_len).
    max_model_len: int | None = None
    source: str = ""
    # Mixture of experts (num_experts == 0: dense).
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one routed expert's width
    shared_expert_intermediate_size: int = 0  # all shared experts' width together
    moe_layers: tuple[int, ...] | None = None  # MoE layer indices; None: every layer (if MoE)
    # Multi-head latent attention (kv_lora_rank == 0: GQA/MHA).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        if not self.is_moe:
            return ()
        return tuple(range(self.num_layers)) if self.moe_layers is None else self.moe_layers

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_indices)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attn_params_per_layer(self) -> int:
        """The attention's projections: QKV and output (GQA), or MLA's q_proj (q_a_proj and
        q_b_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj. Its norms count in `norm_params`."""
        h = self.hidden_size
        if not self.is_mla:
            return h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        qk = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        r = self.q_lora_rank
        q = h * r + r * qk if r else h * qk  # through the q_a/q_b low-rank pair, or q_proj
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + self.num_heads * self.v_head_dim * h

    @property
    def dense_mlp_params_per_layer(self) -> int:
        """The three SwiGLU matrices of a dense layer."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert (three SwiGLU matrices)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer."""
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def moe_params_per_layer(self) -> int:
        """Router, every routed expert and the shared experts of one MoE layer."""
        return self.router_params_per_layer + self.num_experts * self.expert_params \
            + self.shared_expert_params

    @property
    def num_linear_params_per_layer(self) -> int:
        """Attention plus a dense MLP: every linear weight of one layer of a dense model. For an
        MoE model, what one of its dense layers holds; its MoE layers hold
        `attn_params_per_layer + moe_params_per_layer` instead."""
        return self.attn_params_per_layer + self.dense_mlp_params_per_layer

    @property
    def norm_params(self) -> int:
        """RMSNorm weights: two per layer, the final one, and MLA's latent (and query) norms."""
        mla = self.kv_lora_rank + (self.q_lora_rank or 0) if self.is_mla else 0
        return (2 * self.num_layers + 1) * self.hidden_size + self.num_layers * mla

    @property
    def embedding_params(self) -> int:
        """The embedding table plus the LM head unless tied to it."""
        embed = self.vocab_size * self.hidden_size
        return embed if self.tie_embeddings else 2 * embed

    @property
    def num_params(self) -> int:
        layers = self.num_layers * self.attn_params_per_layer \
            + self.num_dense_layers * self.dense_mlp_params_per_layer \
            + self.num_moe_layers * self.moe_params_per_layer
        return layers + self.embedding_params + self.norm_params

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (the
        embedding table counts in full, as in Mistral's 12.9B for Mixtral)."""
        idle = self.num_experts - self.num_experts_per_token
        return self.num_params - self.num_moe_layers * idle * self.expert_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def active_weight_bytes(self) -> int:
        return self.num_active_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (MLA: the cached latent and RoPE key)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes

    @property
    def decode_attn_flops_per_pair_per_layer(self) -> int:
        """FLOPs of one query-key pair in one layer of decode attention. MLA decodes in the
        latent space, as vLLM's MLA backends do (`W_UK` absorbed into the query, `W_UV` into
        the output): QK^T over the latent and RoPE key, PV over the latent, every query head.
        Otherwise as prefill."""
        if self.is_mla:
            return (2 * self.num_heads * (self.kv_lora_rank + self.qk_rope_head_dim)
                    + 2 * self.num_heads * self.kv_lora_rank)
        return self.attn_flops_per_pair_per_layer

    @property
    def attn_flops_per_pair_per_layer(self) -> int:
        """FLOPs of one query-key pair in one layer: QK^T and PV over every query head."""
        if self.is_mla:
            qk_dim, v_dim = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            qk_dim = v_dim = self.head_dim
        return 2 * self.num_heads * qk_dim + 2 * self.num_heads * v_dim


class ModelRegistry(Registry[ModelShape]):
    """Registered model names; a committed config.json is read the first time it is asked for,
    so importing this module reads no file."""

    def __init__(self) -> None:
        super().__init__("model")
        self._files: dict[str, tuple[Path, str]] = {}

    def register(self, name: str) -> Callable[[ModelShape], ModelShape]:
        if name in self._files:
            raise ValueError(f"model {name!r} is registered twice")
        return super().register(name)

    def register_file(self, name: str, path: Path, source: str) -> None:
        if name in self:
            raise ValueError(f"model {name!r} is registered twice")
        self._files[name] = (path, source)

    def get(self, name: str) -> ModelShape:
        if name not in self._entries and name in self._files:
            path, source = self._files[name]
            self._entries[name] = replace(read_config(path), name=name, source=source)
        return super().get(name)

    def names(self) -> list[str]:
        return sorted({*self._entries, *self._files})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._files


MODELS = ModelRegistry()

for _name, _repo in COMMITTED.items():
    MODELS.register_file(_name, DATA_DIR / f"{_name}.json", f"{_repo} config.json"
                         + (" (reconstructed)" if _name in RECONSTRUCTED else ""))
del _name, _repo

# A model small enough to profile on a CPU in seconds; the shape of a Llama, scaled down.
MODELS.register("tiny")(ModelShape("tiny", 4, 256, 4, 2, 64, 688, 4096, max_model_len=32768,
                                   source="servesim test model"))


def resolve_model(value: str, base_dir: Path | None = None) -> ModelShape:
    """A registered model by name, or the model a Hugging Face `config.json` describes: `value`
    is then its path (relative to `base_dir` if given and the path is relative), or a directory
    holding one. The shape's name is `value` as given. ValueError, with one line naming the
    problem, for an unknown name, a missing or unreadable file, bad JSON, a missing or ill-typed
    field, or an architecture that is not modelled."""
    if value in MODELS:
        return MODELS.get(value)
    path = Path(value).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if path.is_dir():  # a Hugging Face snapshot's layout: config.json beside the weights
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: a directory without a config.json (a Hugging Face "
                             "model's directory holds one)")
        path = path / "config.json"
    if not path.exists() and os.sep not in value and "/" not in value \
            and not value.endswith(".json"):
        raise ValueError(f"unknown model {value!r}; known: {', '.join(MODELS.names())}; "
                         "or the path to a Hugging Face config.json")
    shape = read_config(path)
    return replace(shape, name=value)


def read_config(path: Path) -> ModelShape:
    """The shape a config.json describes (named after the file), parsed once per version of the
    file (its resolved path, modification time and size). Anything but a regular file (a device,
    a named pipe) is refused before it is opened, and so is a file past MAX_CONFIG_BYTES; the
    JSON is read strictly (`sim.input_file.loads`: a key given twice, NaN, huge integers, deep
    nesting are refused)."""
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
# `torch_dtype` (or `dtype`, its newer name) -> bytes per weight; absent: bf16.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_MISSING = object()


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
        if "quantization_config" in self.data:
            raise ValueError(f"{self.path}: quantization_config: quantized checkpoints are not "
                             "modelled (their weights would be mis-sized)")
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
        return {"num_experts": experts,
                "num_experts_per_token": self.integer("num_experts_per_tok"),
                "moe_intermediate_size": width,
                "shared_expert_intermediate_size":
                    width * self.integer("n_shared_experts", 0, minimum=0),
                "moe_layers": None if len(moe) == layers else moe}

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
