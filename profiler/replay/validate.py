"""`servesim validate`: replay, then simulate the same requests, and say how far apart they are.

For each scenario (one scheduler each) and load, in one sitting:
1. the profile: measured now on a grid sized from the scenarios (or given, and flagged if it was
   measured on another machine or day);
2. the capacity loads are fractions of: measured by a saturated replay (or given);
3. every point replayed `repeats` times, repeat by repeat, so that replay-vs-replay differences
   include the drift of the machine over the sitting: the floor for any simulator error;
4. simulations of replay 1's requests: `recorded` (replay's own durations: only scheduling and
   queueing can differ), the fitted profile without and with the host overhead measured in the
   other replays (the difference is what host time is worth), the latter again with the
   profile's own measured jitter (`host+noise`: `noise: {kind: empirical, correlation: <the
   profile's>}`, so the table shows P99 TBT with noise off and on), and the roofline;
5. the table: signed relative errors against replay 1, and each latency model's per-iteration
   error on the shapes replay 1 really ran (iterations.csv adds the spread and lag-1
   correlation of replay 1's measured/predicted ratios, beside the profile's).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from profiler.replay.agreement import compare_runs, iteration_error, ratio_spread
from profiler.replay.serve import check_fits, check_replayable, replay
from profiler.replay.validate_profile import (
    fit_flags,
    given_profile,
    machine,
    noise_correlation,
    obtain_profile,
)
from sim.config.errors import COMMAND_LINE, InputError
from sim.config.scenario import Scenario, scenario_yaml
from sim.latency import LATENCY_MODELS, BatchShape
from sim.latency.profile import load_fitted
from sim.results.outdir import check_writable_dir, replace_text
from sim.runner import run_scenario
from sim.studies.progress import ProgressReport
from sim.workloads.load import load_workload, rate_knob, trace_qps, with_rate

SIMULATIONS: dict[str, dict[str, Any]] = {  # name -> latency config (paths: per point)
    "recorded": {"kind": "recorded", "column": "duration_s"},
    "profile": {"kind": "profile"},
    "profile_host": {"kind": "profile"},
    # The profile with host overhead, times the ratios its fit left unexplained; correlation
    # filled in from the profile (`noise.correlation`).
    "host+noise": {"kind": "profile", "noise": {"kind": "empirical"}},
    "roofline": {"kind": "roofline"},
}
PROFILE_OF = {"profile": "profile", "profile_host": "profile_host", "host+noise": "profile_host"}
SATURATED_RPS = 1e6  # arrivals a microsecond apart: all at once


@dataclass
class Options:
    device: str = "cpu"
    loads: list[float] = field(default_factory=lambda: [0.5, 0.8, 0.95])
    profile: Path | None = None
    capacity_rps: float | None = None
    capacity_requests: int | None = None
    repeats: int = 2
    threads: int | None = None
    profile_max_tokens: int | None = None
    profile_reps: int = 5
    profile_holdout: int = 60
    reuse: bool = False
    command: str = ""


@dataclass
class Point:
    label: str  # the scheduler (or scenario) name
    load: float
    rps: float  # arrival rate, requests/s
    scenario: Scenario
    dir: Path

    def replay_dir(self, repeat: int) -> Path:
        return self.dir / f"replay_{repeat}"


def labels_for(scenarios: list[Scenario]) -> list[str]:
    names = [s.replica.scheduler.name for s in scenarios]
    return names if len(set(names)) == len(names) else [s.name for s in scenarios]


def check_inputs(scenarios: list[Scenario], opts: Options) -> str:
    """One model, one colocated replica each, distinct labels; returns the model."""
    for scn in scenarios:
        check_replayable(scn)
    models = {str(s.replica.model) for s in scenarios}
    if len(models) > 1:
        raise InputError(scenarios[0].source, "replica.model", sorted(models),
                         "validate needs every scenario to serve the same model")
    if len(set(labels_for(scenarios))) < len(scenarios):
        raise InputError(scenarios[0].source, "name", [s.name for s in scenarios],
                         "give each scenario its own scheduler or name")
    if not opts.loads or any(not 0 < x <= 2 for x in opts.loads):
        raise InputError(COMMAND_LINE, "--loads", opts.loads, "fractions of capacity in (0, 2]")
    return models.pop()


def at_rate(scenario: Scenario, rps: float, num_requests: int | None = None) -> Scenario:
    """The scenario with arrivals at `rps` requests/s (and only the first N requests)."""
    if num_requests is not None:
        workload = scenario.workload.model_copy(update={"num_requests": num_requests})
        scenario = scenario.model_copy(update={"workload": workload})
    if rate_knob(scenario) == "qps":
        return with_rate(scenario, rps, scenario.seed)
    return with_rate(scenario, rps / trace_qps(scenario), scenario.seed)


def run_replay(scenario: Scenario, out: Path, opts: Options, title: str) -> dict[str, Any]:
    """Replay into `out` (or reuse a complete replay of the same scenario there)."""
    if opts.reuse and _complete(out, scenario):
        return json.loads((out / "summary.json").read_text())
    with ProgressReport(title, "requests") as progress:
        results = replay(scenario, device=opts.device, threads=opts.threads, out_dir=out,
                         progress=progress, command=opts.command)
    if not results.summary["run"]["complete"]:
        raise KeyboardInterrupt  # the replay kept what it measured in `out`
    return results.summary


def _complete(out: Path, scenario: Scenario) -> bool:
    try:
        summary = json.loads((out / "summary.json").read_text())
        same = (out / "scenario.yaml").read_text() == scenario_yaml(scenario)
    except OSError:
        return False
    return same and summary["run"].get("complete", False)


def measure_capacity(scenario: Scenario, label: str, opts: Options, runs: Path
                     ) -> dict[str, Any]:
    """Requests/s one replica serves when it never waits for work: the first K requests (by
    default all of them: a part of a trace can be lighter than the whole, and loads must be
    fractions of what the whole slice needs) arrive at once; capacity = K / time to finish them
    all (the drain at the end included)."""
    n = len(load_workload(scenario))
    k = min(n, opts.capacity_requests or n)
    saturated = at_rate(scenario, SATURATED_RPS, num_requests=k)
    summary = run_replay(saturated, runs / label / "capacity", opts,
                         f"{label}: capacity (saturated replay)")
    makespan = summary["throughput"]["span_s"]
    rps = summary["requests"]["finished"] / makespan
    return {"requests_per_s": rps, "how": f"saturated replay: the first {k} requests arriving "
            f"at once, all finished in {makespan:.2f} s", "dir": str(runs / label / "capacity")}


def replay_facts(dirs: list[Path]) -> dict[str, Any]:
    """When the replays ran and how loaded the machine was meanwhile (1-minute load average)."""
    reps = [json.loads((d / "summary.json").read_text())["replay"] for d in dirs]
    loads = [x for r in reps for x in r.get("loadavg_1m", [])]
    return {"num": len(reps), "first_date": min(r["date"] for r in reps),
            "last_date": max(r["date"] for r in reps),
            "loadavg_1m": [min(loads), max(loads)] if loads else None}


def host_overhead(dirs: list[Path], field: str = "--host-overhead-from") -> dict[str, Any]:
    """Host time per iteration (outside the forward pass) in these replays. A directory that is
    not a replay's (a simulation's iterations have no host time), a corrupt table or a host
    time that is not a finite time >= 0 is one `InputError` line naming it and `field`."""
    from sim.results.read import read_parquet

    parts = []
    for d in dirs:
        if not (d / "iterations.parquet").is_file():
            raise InputError(d, field, str(d), "not a replay directory (no iterations.parquet)")
        its = read_parquet(d / "iterations.parquet")
        if "host_s" not in its:
            raise InputError(d, field, str(d), "not a replay directory: its iterations have no "
                             "host_s (a simulation's results? give `servesim replay`'s)")
        host = its["host_s"].to_numpy(np.float64)
        bad = np.flatnonzero(~(np.isfinite(host) & (host >= 0)))
        if bad.size:
            raise InputError(d / "iterations.parquet", "host_s", host[bad[0]],
                             f"row {int(bad[0])}: must be a finite time >= 0 s")
        parts.append(host)
    host = np.concatenate(parts)
    if not host.size:
        raise InputError(dirs[0], field, ", ".join(map(str, dirs)),
                         "the replays ran no iteration: no host time to measure")
    return {"median_s": float(np.median(host)), "mean_s": float(host.mean()),
            "p10_s": float(np.percentile(host, 10)), "p90_s": float(np.percentile(host, 90)),
            "num_iterations": int(host.size), "replays": [str(d) for d in dirs]}


def simulate_point(point: Point, profiles: dict[str, Path], say: Any) -> None:
    """The simulations of replay 1's requests, each beside it. One that fails (e.g. a given
    profile extrapolating to a negative time) is reported and left out of the table."""
    reference = point.replay_dir(1)
    for name, spec in SIMULATIONS.items():
        cfg: dict[str, Any] = dict(spec)
        if cfg["kind"] == "recorded":
            cfg["path"] = reference
        elif cfg["kind"] == "profile":
            cfg["path"] = profiles[PROFILE_OF[name]]
        if cfg.get("noise", {}).get("kind") == "empirical":
            correlation = noise_correlation(cfg["path"])
            if correlation is None:  # a profile fitted before ratios were kept (said once)
                continue
            cfg["noise"] = {**cfg["noise"], "correlation": correlation}
        latency = LATENCY_MODELS.get(cfg["kind"]).Config.model_validate(cfg)
        replica = point.scenario.replica.model_copy(update={"latency": latency})
        out = point.dir / f"sim_{name}"
        try:
            run_scenario(point.scenario.model_copy(update={"replica": replica}), out_dir=out)
        except Exception as exc:  # one simulation's failure must not lose the sitting
            shutil.rmtree(out, ignore_errors=True)
            say(f"warning: {point.label} load {point.load:.2f}: the {name} simulation failed: "
                f"{type(exc).__name__}: {exc}")


def point_rows(point: Point, repeats: int) -> list[dict[str, Any]]:
    """One row per comparison with replay 1: later replays (the floor), then simulations."""
    reference = point.replay_dir(1)
    others = [(f"replay_{r}", point.replay_dir(r)) for r in range(2, repeats + 1)]
    others += [(name, point.dir / f"sim_{name}") for name in SIMULATIONS]
    return [{"scheduler": point.label, "load": point.load, "rate_rps": point.rps,
             "compared": name, **(compare_runs(reference, other) if (other / "summary.json")
                                  .is_file() else {"failed": True})}
            for name, other in others]


def iteration_rows(point: Point, profiles: dict[str, Path]) -> list[dict[str, Any]]:
    """Each latency model's error on the iterations replay 1 ran (their exact shapes)."""
    its = pd.read_parquet(point.replay_dir(1) / "iterations.parquet")
    shape = BatchShape(**{name: its[name].to_numpy(dtype=np.float64) for name in (
        "num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens", "num_sampled_tokens",
        "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")})
    cfg = point.scenario.replica
    model, gpu = cfg.model_shape, cfg.gpu_spec
    models = {name: LATENCY_MODELS.get(SIMULATIONS[name]["kind"])(
        LATENCY_MODELS.get(SIMULATIONS[name]["kind"]).Config.model_validate(
            {**SIMULATIONS[name], **({"path": profiles[name]} if name in profiles else {})}),
        model, gpu) for name in ("profile", "profile_host", "roofline")}
    row: dict[str, Any] = {"scheduler": point.label, "load": point.load,
                           "num_iterations": len(its),
                           "forward_ms_median": 1e3 * float(its["forward_s"].median()),
                           "host_ms_median": 1e3 * float(its["host_s"].median()),
                           "host_share": float(its["host_s"].sum() / its["duration_s"].sum()),
                           "wake_ms_max": 1e3 * float(its["wake_s"].max()),
                           "num_scattered_seqs": int(its["num_scattered_seqs"].sum())}
    for name, latency in models.items():
        predicted = np.broadcast_to(np.asarray(latency.iteration_time_s(shape), dtype=float),
                                    (len(its),))
        targets = ["duration_s"] + (["forward_s"] if name == "profile" else [])
        for target in targets:
            err = iteration_error(its[target].to_numpy(), predicted)
            for key, value in err.items():
                if key != "n":
                    row[f"{name}_vs_{target.removesuffix('_s')}_{key}"] = value
        if name == "profile":  # the jitter the noise variant draws, against replay's own
            row.update(ratio_spread(its["forward_s"].to_numpy(), predicted, its, latency))
    return [row]


# What `run_validation` writes into its directory (and `servesim report` adds).
VALIDATION_ENTRIES = frozenset({"errors.csv", "iterations.csv", "meta.json", "table.txt",
                                "validation.png", "profile", "profile_host.json", "runs",
                                "report.html"})


# A sitting's own tables, removed when the next one starts (runs/ and profile/ are reused).
SITTING_FILES = ("errors.csv", "iterations.csv", "meta.json", "table.txt", "validation.png",
                 "profile_host.json", "report.html")


def check_validation_out(out: Path) -> None:
    """`--out` is a new directory or an earlier sitting's, checked before anything is measured:
    a file ended in a traceback after the checks, and any directory was written into, its
    own files left among the sitting's (`--out scenarios` would have mixed them)."""
    check_writable_dir(out)
    if not out.is_dir():
        return
    for entry in sorted(out.iterdir(), key=lambda e: e.name):
        if entry.name not in VALIDATION_ENTRIES or entry.is_symlink():
            raise InputError(out, "--out", str(out), f"holds {entry.name!r}, which validate "
                             "does not write (not an earlier sitting): choose another directory")


def run_validation(scenarios: list[Scenario], opts: Options, out: Path, say: Any
                   ) -> dict[str, Any]:
    """The whole sitting; writes errors.csv, iterations.csv, meta.json, table.txt and
    validation.png into `out` (runs in `out/runs`); returns the meta with the table lines."""
    from profiler.measure.device import torch_setup

    model = check_inputs(scenarios, opts)
    check_validation_out(out)
    _, dtype = torch_setup(opts.device, opts.threads)
    for scn in scenarios:
        check_fits(scn, opts.device, dtype)
    if opts.profile is not None:
        given_profile(opts.profile, model)
    # The previous sitting's tables go before anything is measured: never beside this one's runs.
    for name in SITTING_FILES:
        (out / name).unlink(missing_ok=True)
    try:
        return _sitting(scenarios, model, opts, out, say)
    except KeyboardInterrupt:
        out.mkdir(parents=True, exist_ok=True)
        replace_text(out / "meta.json", json.dumps(
            {"complete": False, "command": opts.command,
             "interrupted": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")},
            indent=1, sort_keys=True) + "\n")
        say(f"interrupted: no tables written (meta.json: complete false); what ran is in "
            f"{out}/runs, each replay marked complete or not: the same command with --reuse "
            "goes on from it")
        raise


def _sitting(scenarios: list[Scenario], model: str, opts: Options, out: Path, say: Any
             ) -> dict[str, Any]:
    from profiler.fit.fitting import add_host_overhead
    from profiler.replay.report import (
        error_table,
        figure,
        goal_lines,
        header_lines,
        iteration_table,
        verdict_lines,
    )

    here = machine(opts.device)
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    runs = out / "runs"
    profile_path, profile_info = obtain_profile(scenarios, model, opts, out, here, say)
    out.mkdir(parents=True, exist_ok=True)
    profile_info["flags"] += fit_flags(profile_info.get("holdout"))
    for flag in profile_info["flags"]:
        say(f"warning: profile {profile_path} {flag}")
    labels = labels_for(scenarios)
    capacity: dict[str, dict[str, Any]] = {}
    for label, scn in zip(labels, scenarios, strict=True):
        capacity[label] = ({"requests_per_s": opts.capacity_rps, "how": "given (--capacity)"}
                           if opts.capacity_rps else measure_capacity(scn, label, opts, runs))
        say(f"{label}: capacity {capacity[label]['requests_per_s']:.3g} req/s "
            f"({capacity[label]['how']})")
    points = [Point(label, load, load * capacity[label]["requests_per_s"],
                    at_rate(scn, load * capacity[label]["requests_per_s"]),
                    runs / label / f"load_{load:.2f}")
              for label, scn in zip(labels, scenarios, strict=True) for load in opts.loads]
    for repeat in range(1, opts.repeats + 1):  # repeat by repeat: replays 1 and 2 far apart
        for p in points:
            run_replay(p.scenario, p.replay_dir(repeat), opts,
                       f"{p.label} load {p.load:.2f}: replay {repeat}/{opts.repeats}")
    later = [p.replay_dir(r) for p in points for r in range(2, opts.repeats + 1)]
    host = host_overhead(later or [p.replay_dir(1) for p in points])
    profiles = {"profile": profile_path, "profile_host": out / "profile_host.json"}
    fitted = load_fitted(profile_path)
    if noise_correlation(profile_path) is None:
        say(f"warning: profile {profile_path} keeps no measured ratios (fitted before they "
            "were kept): no host+noise simulation; fit it again with `servesim fit`")
    profiles["profile_host"].write_text(json.dumps(
        add_host_overhead(fitted, host["median_s"], host), indent=1, sort_keys=True) + "\n")
    for p in points:
        simulate_point(p, profiles, say)
    errors = pd.DataFrame([row for p in points for row in point_rows(p, opts.repeats)])
    iters = pd.DataFrame([row for p in points for row in iteration_rows(p, profiles)])
    meta = {"date": date, "model": model, "machine": here, "loadavg_end": list(os.getloadavg()),
            "replays": replay_facts([p.replay_dir(r) for p in points
                                     for r in range(1, opts.repeats + 1)]),
            "command": opts.command, "profile": profile_info, "capacity": capacity,
            "host": host, "loads": opts.loads, "repeats": opts.repeats,
            "scenarios": [s.source for s in scenarios], "complete": True}
    errors.to_csv(out / "errors.csv", index=False)
    iters.to_csv(out / "iterations.csv", index=False)
    (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
    lines = (header_lines(meta) + error_table(errors) + verdict_lines(errors)
             + iteration_table(iters) + goal_lines(errors))
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    figure(errors, meta, out / "validation.png")
    meta["lines"] = lines
    return meta
