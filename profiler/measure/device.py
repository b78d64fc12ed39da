"""The device a measurement runs on: torch set up for it, and the one-line refusals of a model the
profiler cannot build or that would not fit in its memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.config.errors import COMMAND_LINE, InputError
from sim.hardware.models import ModelShape


def torch_setup(device: str, threads: int | None) -> tuple[Any, Any]:
    """torch, set up for `device` (threads on the CPU), and the dtype measured there."""
    import torch

    if device != "cpu" and not device.startswith("cuda"):
        raise InputError(COMMAND_LINE, "--device", device, "expected cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(COMMAND_LINE, "--device", device, "CUDA is not available on this machine")
    if device == "cpu":
        # One thread by default: steadier timings than a pool shared with the rest of the box.
        torch.set_num_threads(threads or 1)
    return torch, (torch.bfloat16 if device.startswith("cuda") else torch.float32)


def check_buildable(shape: ModelShape, source: Path | str, field: str, value: Any) -> None:
    """One line, exit 2, for a model the profiler's decoder cannot build (`unbuildable`)."""
    from profiler.measure.model import unbuildable

    if why := unbuildable(shape):
        raise InputError(source, field, value, why)


def check_memory(shape: ModelShape, num_kv_slots: int, device: str, dtype: Any,
                 tensor_parallel: int, source: Path | str, field: str, value: Any) -> None:
    """One line, exit 2, where the decoder and its KV pool would not fit in memory here."""
    from profiler.measure.model import does_not_fit

    problem = does_not_fit(shape, num_kv_slots, device, dtype, tensor_parallel)
    if problem is not None:
        raise InputError(source, field, value, f"{problem[0]}: profile a smaller model here"
                         + (" or give a smaller --max-context / --max-batch" if problem[1]
                            else ""))
