"""`servesim validate`'s profile: the fitted latency profile a sitting is judged with, given
(checked against the scenarios' model, and flagged where it may not describe this machine now:
another device, other torch threads, measured hours ago, a poor fit to its own held-out mixes)
or measured now on a grid sized from the scenarios; and the facts about it that meta.json keeps.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from profiler.replay.serve import largest_iteration
from sim.config.errors import InputError
from sim.config.scenario import Scenario
from sim.hardware.models import resolve_model
from sim.latency.profile import load_fitted
from sim.studies.progress import ProgressReport
from sim.workloads.load import load_workload

if TYPE_CHECKING:
    from profiler.replay.validate import Options

# A fitted profile whose mean error on its own held-out mixes is larger is flagged: the
# committed CPU profile's is 9.7%, a GPU's a few percent.
MAX_HOLDOUT_MAPE = 0.2
STALE_PROFILE_H = 12.0


def machine(device: str) -> dict[str, Any]:
    """What ran it: the profiler's environment facts plus cores and load averages."""
    import torch

    from profiler.measure.timing import default_attention, environment

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    info = environment(device, dtype, default_attention(device))
    info["cpu_count"] = os.cpu_count()
    info["loadavg_start"] = list(os.getloadavg())
    return info


def obtain_profile(scenarios: list[Scenario], model: str, opts: Options, out: Path,
                   here: dict[str, Any], say: Any) -> tuple[Path, dict[str, Any]]:
    """The fitted profile to validate: given (checked, flagged if stale) or measured now."""
    if opts.profile is not None:
        fitted = given_profile(opts.profile, model)
        return opts.profile, {"source": str(opts.profile), "measured_now": False,
                              "date": fitted.get("measurement", {}).get("date"),
                              "flags": profile_flags(fitted, here),
                              "holdout": fitted.get("holdout"), "noise": noise_facts(fitted)}
    return measure_profile(scenarios, model, opts, out / "profile", say)


def given_profile(path: Path, model: str) -> dict[str, Any]:
    """A fitted profile given with --profile, of the scenarios' model."""
    fitted = load_fitted(path, "--profile")
    if fitted["model"] != model:
        raise InputError(path, "model", fitted["model"],
                         f"profile was measured for {fitted['model']}, the scenarios run {model}")
    return fitted


def profile_flags(fitted: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Why a given profile may not describe this machine now."""
    meas = fitted.get("measurement", {})
    flags = []
    if meas.get("device_name") != here.get("device_name"):
        flags.append(f"measured on {meas.get('device_name')}, not {here.get('device_name')}")
    if meas.get("torch_threads") not in (None, here.get("torch_threads")):
        flags.append(f"measured with {meas.get('torch_threads')} torch threads")
    try:
        then = dt.datetime.strptime(meas["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        age_h = (dt.datetime.now(dt.UTC) - then).total_seconds() / 3600
        if age_h > STALE_PROFILE_H:
            flags.append(f"measured {age_h:.0f} h ago ({meas['date']}), not in this sitting")
    except (KeyError, ValueError):
        flags.append("no measurement date")
    return flags


def fit_flags(holdout: dict[str, Any] | None) -> list[str]:
    """Why a profile, given or measured now, predicts its own held-out mixes too poorly for
    the simulations built on it to be judged against replays."""
    mape = (holdout or {}).get("mape")
    if mape is None:
        return ["records no held-out error: how well it fits is unknown"]
    if mape > MAX_HOLDOUT_MAPE:
        return [f"misses its own held-out mixes by {mape:.1%} (mean; over "
                f"{MAX_HOLDOUT_MAPE:.0%}): simulations on it cannot be judged against replays "
                "closer than that; measure again with more --profile-reps or on a quieter "
                "machine"]
    return []


def profile_spec(scenarios: list[Scenario], opts: Options) -> Any:
    """A grid covering what the scenarios run: their largest iteration, longest context and
    largest batch (a reduced grid on a CPU: minutes, not hours)."""
    from profiler.measure.mixes import GridSpec

    tokens = max(largest_iteration(s) for s in scenarios)
    if opts.profile_max_tokens is not None:
        tokens = min(tokens, opts.profile_max_tokens)
    context = 256
    for scn in scenarios:
        w = load_workload(scn)
        context = max(context, int((w.num_prompt_tokens + w.num_output_tokens).max()))
    context = min(-(-context // 256) * 256, 16384)
    batch = min(128, max(s.replica.scheduler.max_num_seqs for s in scenarios))
    return GridSpec(max_tokens=tokens, max_context=context, max_batch=batch,
                    max_kv_tokens=max(65536, 2 * context))


def measure_profile(scenarios: list[Scenario], model: str, opts: Options, where: Path,
                    say: Any) -> tuple[Path, dict[str, Any]]:
    from profiler.fit.fitting import fit_profile
    from profiler.measure.device import check_memory, torch_setup
    from profiler.measure.mixes import grid, random_mixes
    from profiler.measure.timing import default_attention, load
    from profiler.measure.timing import profile as measure

    fitted_path = where / "profile.json"
    parquet = where / "profile.parquet"
    if not (opts.reuse and fitted_path.is_file()):
        if where.exists():
            shutil.rmtree(where)  # measured afresh: this sitting's machine, not an earlier one
        _, dtype = torch_setup(opts.device, opts.threads)
        spec = profile_spec(scenarios, opts)
        check_memory(resolve_model(model), spec.max_kv_tokens, opts.device, dtype, 1,
                     scenarios[0].source, "replica.model", model)
        rng = np.random.default_rng(0)
        mixes = [(m, "train") for m in grid(spec, rng)]
        mixes += [(m, "holdout") for m in random_mixes(spec, opts.profile_holdout, rng)]
        say(f"profiling {model} on {opts.device}: {len(mixes)} mixes, grid {spec}")
        with ProgressReport(f"profiling {model}", "mixes", total=len(mixes)) as progress:
            measure(resolve_model(model), opts.device, parquet, spec, mixes, dtype=dtype, warmup=1,
                    reps=opts.profile_reps, seed=0, command=opts.command,
                    attention=default_attention(opts.device),
                    on_progress=lambda done, total: progress.update(done, total))
        df, meta = load(parquet)
        fitted = fit_profile(df, meta)
        fitted["source"] = str(parquet)
        fitted_path.write_text(json.dumps(fitted, indent=1, sort_keys=True) + "\n")
    fitted = load_fitted(fitted_path)
    return fitted_path, {"source": str(fitted_path), "measured_now": True, "flags": [],
                         "date": fitted["measurement"]["date"],
                         "grid": fitted["measurement"]["grid"], "holdout": fitted["holdout"],
                         "noise": noise_facts(fitted)}


def noise_facts(fitted: dict[str, Any]) -> dict[str, Any] | None:
    """The profile's `noise` section for meta.json: the quantile lists left out."""
    noise = fitted.get("noise")
    if not isinstance(noise, dict):
        return None
    out = {k: v for k, v in noise.items() if k != "regimes"}
    if isinstance(noise.get("regimes"), dict):
        out["regimes"] = {name: {k: v for k, v in r.items() if k != "quantiles"}
                          for name, r in noise["regimes"].items()}
    return out


def noise_correlation(profile: Path) -> float | None:
    """The correlation fitted with the profile's ratios; None if it keeps no ratios (fitted
    before they were kept)."""
    noise = load_fitted(profile).get("noise") or {}
    return float(noise.get("correlation") or 0.0) if noise.get("regimes") else None
