"""Decoder model shapes: dense (Llama, Mistral, Qwen2/3), MoE (Mixtral, Qwen-MoE, DeepSeek) and
DeepSeek's multi-head latent attention (MLA); SwiGLU MLPs and RMSNorm throughout.

Shared by the roofline model, the KV sizing and the profiler, which builds the same model with
random weights. A model is a registered name (`MODELS`: the Hugging Face `config.json` files
committed under `sim/data/models/`, read on first use, plus `tiny`, a hand-made CPU test model)
or the path to a `config.json` (`resolve_model`; `sim.hardware.hf_config` reads the files, with the
standard library only: no transformers, no weights, no network).

The shape itself, and its parameter counts, are `sim.hardware.shape.ModelShape`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from sim.core.registry import Registry
from sim.hardware.hf_config import read_config
from sim.hardware.shape import ModelShape

__all__ = ["COMMITTED", "DATA_DIR", "MODELS", "ModelShape", "resolve_model"]

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "models"
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
    # The fp8 checkpoint (block-quantized linear weights, `quantization_config`); 61 layers,
    # the multi-token-prediction layer (`num_nextn_predict_layers`) not among them.
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
}
# Written from the published values rather than copied (no copy of the file was found).
RECONSTRUCTED = frozenset({"llama-3.1-70b", "qwen2.5-72b", "deepseek-v2-lite"})


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
    return replace(read_config(path), name=value)

