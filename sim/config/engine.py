"""Engine calibrations: the few physical coefficients of a serving engine's time that the
roofline cannot derive (host time per step, its all-reduce kernel, attention's KV bandwidth, the
API front end's latency), fitted per engine and GPU to measured serving runs, with where they
came from and how far runs made with them are from the measurements.

A replica names one as `replica.engine`: a shipped calibration (`servesim list`), a YAML
file of the same fields, `none` (the roofline's own defaults, no front end) or `auto` (the
default): the shipped calibration of the replica's engine family, vLLM's for every scheduler but
`sglang` (none is shipped for SGLang yet). Its `latency` fields become the defaults of a roofline
latency model (fields given under `replica.latency` win; another latency model takes none), and
its front end turns engine-side latencies into client-side ones (`client_ttft_s`,
`client_e2e_s`). The resolved scenario names the calibration and spells out its fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from sim.config.base import Frozen
from sim.config.errors import InputError
from sim.config.yaml_input import read_yaml

AUTO, NONE = "auto", "none"
# `auto` for a replica whose scheduler is one of these: no calibration (none is shipped).
UNCALIBRATED_SCHEDULERS = frozenset({"sglang"})
DEFAULT_CALIBRATION = "vllm-0.15.1-h100"
# How far iteration times may be off on a GPU no calibration measured: the H100 calibration's
# roofline on vLLM 0.19.0's RTX runs was off by up to 24% in TPOT (validation/public/
# rtx_vllm0190.md, Qwen3-32B on two RTX PRO 6000s).
EXTRAPOLATED_BAND = 0.25


class EngineCalibration(Frozen):
    """One engine calibration (a file under `sim/data/engines/`, or the user's)."""

    name: str = Field(min_length=1, max_length=100, description="what results call it")
    engine: str = Field(min_length=1, max_length=100,
                        description="the engine and version measured, e.g. vllm 0.15.1")
    gpu: str = Field("", max_length=100, description="the GPU measured")
    latency: dict[str, Any] = Field(
        default_factory=dict, description="roofline fields (`replica.latency`) this engine's "
                                          "runs fitted, the defaults of a roofline replica")
    frontend_s: float = Field(
        0.0, ge=0, le=10, description="client send to first byte back, beyond the engine: HTTP, "
                                      "API server, tokenisation, hops to and from the engine "
                                      "core, detokenisation, streaming")
    frontend_per_extra_gpu_s: float = Field(
        0.0, ge=0, le=1, description="added per GPU of a replica beyond the first (vLLM's "
                                     "multiprocess executor: inputs broadcast to each worker)")
    provenance: str = Field("", max_length=4000, description="what was fitted to, and how")
    error: str = Field("", max_length=4000,
                       description="how far runs made with it are from the measurements")
    error_band: float = Field(
        EXTRAPOLATED_BAND, ge=0, le=1,
        description="iteration times are trusted within this fraction either way on the GPU "
                    "measured (the worst model's median error of TPOT and E2E, held out); other "
                    "GPUs get EXTRAPOLATED_BAND")

    def band(self, gpu: str) -> tuple[float, bool]:
        """(fraction, extrapolated) for a replica on `gpu`: this calibration's band on the
        GPU it measured, EXTRAPOLATED_BAND on any other."""
        if self.gpu and gpu == self.gpu:
            return self.error_band, False
        return max(self.error_band, EXTRAPOLATED_BAND), True

    def frontend_latency_s(self, num_gpus: int) -> float:
        """The front end's latency for a replica of `num_gpus` GPUs: added to TTFT and E2E."""
        return self.frontend_s + self.frontend_per_extra_gpu_s * max(num_gpus - 1, 0)


def calibration_text(facts: Mapping[str, Any]) -> str:
    """One line naming a calibration and its measured error, from its fields (an
    `EngineCalibration`'s, or a summary's `latency_model.calibration`), with each pool's
    error band (`bands`, where given): a GPU the calibration did not measure is flagged."""
    gpu = f", {facts['gpu']}" if facts.get("gpu") else ""
    text = f"engine calibration {facts['name']} ({facts['engine']}{gpu}): {facts['error']}"
    for pool, band in (facts.get("bands") or {}).items():
        where = f" ({pool})" if pool in ("prefill", "decode") else ""
        if band["extrapolated"] and not facts.get("gpu"):
            text += (f"; UNCALIBRATED{where}: iteration times on {band['gpu']} trusted within "
                     f"+/-{100 * band['band']:.0f}% at best")
        elif band["extrapolated"]:
            text += (f"; EXTRAPOLATED{where}: {band['gpu']} is not the GPU it measured, "
                     f"iteration times trusted within +/-{100 * band['band']:.0f}% at best")
        else:
            text += (f"; iteration times within +/-{100 * band['band']:.0f}% on "
                     f"{band['gpu']}{where}")
    return text


def band_facts(calibration: EngineCalibration, gpu: str) -> dict[str, Any]:
    """A pool's error band, as summaries keep it (`calibration_text` reads it)."""
    band, extrapolated = calibration.band(gpu)
    return {"gpu": gpu, "band": band, "extrapolated": extrapolated}


UNCALIBRATED = EngineCalibration(
    name=NONE, engine="any", provenance="none: the roofline's defaults, no front end",
    error="not validated as a whole: see the latency model's own error")


def shipped_names() -> list[str]:
    """The shipped calibrations' names (`sim/data/engines/<name>.yaml`)."""
    folder = resources.files("sim") / "data" / "engines"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir()
                  if p.name.endswith(".yaml"))


def auto_name(scheduler_name: str) -> str:
    """The calibration `auto` stands for with this scheduler."""
    return NONE if scheduler_name in UNCALIBRATED_SCHEDULERS else DEFAULT_CALIBRATION


def is_name(value: str) -> bool:
    """A calibration's name (or `auto`/`none`), not a file's path."""
    return "/" not in value and not value.endswith((".yaml", ".yml"))


@lru_cache(maxsize=64)
def load_calibration(engine: str | Path) -> EngineCalibration:
    """A shipped calibration by name, `none`, or a YAML file (raising InputError naming the
    file and the field at fault), its latency fields checked as a roofline's."""
    from sim.latency import LATENCY_MODELS

    calibration, path = read_calibration(engine)
    if path is None:  # `none`: the roofline's own defaults
        return calibration
    try:  # checked as a roofline's now, not in each scenario using it
        LATENCY_MODELS.get("roofline").Config.model_validate(
            {**calibration.latency, "kind": "roofline"})
    except ValidationError as exc:
        error = InputError.from_validation(path, exc)
        raise InputError.many(path, [(f"latency.{field}", value, problem)
                                     for field, value, problem in error.problems]) from None
    return calibration


def read_calibration(engine: str | Path) -> tuple[EngineCalibration, Path | None]:
    """A calibration and its file (None for `none`), its latency fields not yet checked as a
    roofline's (which imports the latency models: `servesim list` only shows them)."""
    if isinstance(engine, str) and is_name(engine):
        if engine == NONE:
            return UNCALIBRATED, None
        if engine not in shipped_names():
            raise ValueError(f"unknown engine calibration; known: "
                             f"{', '.join([AUTO, NONE, *shipped_names()])}, or a YAML file")
        path = Path(str(resources.files("sim") / "data" / "engines" / f"{engine}.yaml"))
    else:
        path = Path(engine)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise InputError(path, "<top level>", type(data).__name__,
                         "an engine calibration is a mapping")
    try:
        calibration = EngineCalibration.model_validate(data)
    except ValidationError as exc:
        raise InputError.from_validation(path, exc) from None
    if "kind" in calibration.latency:
        raise InputError(path, "latency.kind", calibration.latency["kind"],
                         "a calibration's latency fields are a roofline's: give no kind")
    return calibration, path


def with_engine(replica: dict[str, Any], base_dir: Path | None) -> tuple[dict[str, Any],
                                                                          str | None]:
    """A replica's mapping with its calibration applied: `engine` resolved (`auto` to a name, a
    file's path made absolute) and, for a roofline, the calibration's latency fields as
    defaults. Returns the mapping and a problem with `engine` (None if it loaded)."""
    engine = replica.get("engine", AUTO)
    if isinstance(engine, Path):
        engine = str(engine)
    if not isinstance(engine, str) or not engine:
        return replica, "must be a calibration's name or a YAML file's path"
    if engine == AUTO:
        scheduler = replica.get("scheduler")
        name = (scheduler.get("name") if isinstance(scheduler, dict)
                else getattr(scheduler, "name", "chunked_prefill"))
        engine = auto_name(name if isinstance(name, str) else "")
    resolved: str | Path = engine
    if not is_name(engine):
        path = Path(engine).expanduser()
        resolved = path if path.is_absolute() or base_dir is None else base_dir / path
    try:
        calibration = load_calibration(resolved)
    except ValueError as exc:
        return replica, str(exc)
    out = {**replica, "engine": resolved}
    latency = replica.get("latency")
    if calibration.latency and (latency is None or (
            isinstance(latency, dict) and latency.get("kind") == "roofline")):
        out["latency"] = {"kind": "roofline", **calibration.latency, **(latency or {})}
    return out, None
