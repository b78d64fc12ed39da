"""servesim against public measurements of real vLLM v0.15.1 on H100-SXM: every load stage of
`../shared/realruns/h100_vllm0151/runs.csv` simulated as recorded, and the error table.

    python validation/public/h100_vllm0151.py [--realruns DIR] [--stage NAME ...]
        [--set FIELD=VALUE ...] [--out FILE.md] [--jobs N]

Each experiment is simulated as one run of its load stages, with the engine settings the runs
recorded (vLLM v1 `0.15.1`, budget 2,048, 128 sequences, chunked prefill, prefix caching on
16-token blocks, KV at 0.9 of memory), the default engine calibration, and the workload as
inference-perf's client sent it (`shared_prefix`: 10 groups x 10 prompts cycled, `max_tokens`
generated, each stage's rate and duration, stages 10 s apart so the server idles between them
with its prefix cache warm, as the real one did). Prompt lengths are the client tokenizer's
mean (caveat 3 of the data's README). Nothing is fitted per run: `--set` changes a replica
field for every experiment (e.g. `latency.overhead_s=0`). The scenarios are those `servesim
calibrate` builds (`sim.studies.measured.read_stages`).

Compared (servesim minus measured, over measured): TPOT mean and P50, TTFT mean, P50 and
P99, E2E mean, on the stable stages; and on every stage whether servesim calls it overloaded
where the real server was (`overloaded_measured`). TTFT and E2E are client-side on both sides
(servesim's `client_ttft_s` and `client_e2e_s`: the engine's plus the calibration's front end).

The measurements are not the project's (no licence upstream): they are read from `../shared/`
at run time and only the errors are printed or written, never the figures.

The client's timeout is simulated as the runs had it (none set: aiohttp's default, 300 s
total); where requests timed out (the reasoning stages), the last column gives the share that
finished in time, simulated and real.

The runs' KV offloading to CPU (an 8 GiB `OffloadingConnector`) is simulated as recorded
(`replica.kv_offload`, vLLM 0.15.1's connector; `--set kv_offload=null` turns it off).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sim.studies.measured import METRICS, errors_pct

sys.path.insert(0, str(Path(__file__).parent))
from common import error_cells, median_row, replica_fields, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REALRUNS = ROOT.parent / "shared" / "realruns" / "h100_vllm0151"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--realruns", type=Path, default=REALRUNS)
    parser.add_argument("--stage", action="append", help="only these stages (name@rate)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a replica field for every stage, e.g. latency.overhead_s=0")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    path = args.realruns / "runs.csv"
    if not path.is_file():
        print(f"{path}: not found (give --realruns)", file=sys.stderr)
        return 2
    from sim.config.errors import InputError
    from sim.studies.measured import read_stages, simulate

    replica = replica_fields(args.set)
    try:
        experiments = read_stages(path)
        if args.stage:  # whole experiments run; only the stages asked for are shown
            experiments = [e for e in experiments if any(s.name in args.stage for s in e.stages)]
        with ProcessPoolExecutor(args.jobs) as pool:
            runs = list(pool.map(simulate, [(e, replica) for e in experiments]))
    except InputError as e:
        print(e, file=sys.stderr)
        return 2
    stages, sims = [], []
    for exp, run in zip(experiments, runs, strict=True):
        for stage, got in zip(exp.stages, run, strict=True):
            if not args.stage or stage.name in args.stage:
                stages.append(stage)
                sims.append(got)
    calibration = yaml.safe_load(scenario_engine(experiments[0], replica)) if experiments else {}

    lines = ["servesim vs vLLM 0.15.1 on H100-SXM: (servesim - measured) / measured, %"
             + (f"; --set {' '.join(args.set)}" if args.set else ""),
             "",
             "| stage | " + " | ".join(name for name, *_ in METRICS)
             + " | overloaded (sim/real) | succeeded % (sim/real) |",
             "|---|" + "---:|" * len(METRICS) + "---|---:|"]
    errors = errors_pct(stages, sims, np.zeros(len(stages)))
    for stage, sim, row in zip(stages, sims, errors, strict=True):
        verdict = (f"{'yes' if sim['overloaded'] else 'no'}/"
                   f"{'yes' if stage.overloaded else 'no'}")
        lines.append(f"| {stage.name} | {error_cells(row)} | {verdict} | "
                     f"{succeeded_cell(sim['succeeded'], stage.succeeded)} |")
    equal = sum(sim["overloaded"] == stage.overloaded for stage, sim in zip(stages, sims,
                                                                             strict=True))
    lines.append(median_row("median abs, stable", errors, f"{equal}/{len(stages)} equal |"))
    lines.append("| worst abs, stable | " + " | ".join(
        f"{max(values):.1f}" if (values := [abs(e) for row in errors
                                            if (e := row[name]) is not None]) else ""
        for name, *_ in METRICS) + " | | |")
    lines += ["", f"engine calibration: {yaml.safe_dump(calibration, width=96).strip()}"]
    report("\n".join(lines), args.out, "h100_vllm0151.py")
    return 0


def succeeded_cell(sim: float | None, real: float | None) -> str:
    """Requests that finished within the client's timeout, simulated and real, where either
    lost any (the others succeeded whole on both sides)."""
    if sim is None or real is None or (sim == 1.0 and real == 1.0):
        return ""
    return f"{100 * sim:.1f}/{100 * real:.1f}"


def scenario_engine(experiment: Any, replica: dict[str, Any]) -> str:
    """The engine calibration the experiments ran with (name and fitted figures), as YAML."""
    from sim.config.scenario import merge_mappings, parse_scenario

    data = merge_mappings(experiment.scenario, {"replica": replica})
    cfg = parse_scenario(data, experiment.name).replica
    cal = cfg.calibration
    return yaml.safe_dump({"name": cal.name, "latency": cal.latency,
                           "frontend_s": cal.frontend_s,
                           "frontend_per_extra_gpu_s": cal.frontend_per_extra_gpu_s})


if __name__ == "__main__":
    raise SystemExit(main())
