"""servesim against public measurements of real vLLM 0.19.0 on RTX GPUs: every run of
`../shared/realruns/rtx_vllm0190` (LLMServingSim's validation examples, MIT) simulated as
recorded, and the error table.

    python validation/public/rtx_vllm0190.py [--realruns DIR] [--set FIELD=VALUE ...]
        [--out FILE.md]

Each run's 300 requests are replayed as its engine core received them (arrivals at
`queued_ts`, prompt and output lengths as served) on the deployment its `meta.json` gives
(model, TP, `max_num_seqs`, budget, the KV blocks the engine logged where it did), with the
default engine calibration, and compared engine-side (the runs drove vLLM's `AsyncLLM` in
process: no HTTP server). `sim.studies.measured.read_engine_run` builds each. Every run is
overloaded (10 req/s of ~1,500-token requests): TTFT is mostly queueing, and the comparison is
of whole runs. The RTX PRO 6000 edition is not recorded: its runs are shown with `rtxpro6000`
(the Workstation Edition's figures) and with the Server Edition's (1,597 GB/s; ~468 TFLOP/s
bf16 derived from its clock, none published).
The data-parallel MoE run (Qwen3-30B-A3B, DP2 with expert parallelism) is one replica of two
ranks in lockstep (`parallelism: {data: 2, expert: 2}`). Known gap: prefix caching has no hash
ids here (at most 7.6% of prompt tokens repeat).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from sim.studies.measured import METRICS, errors_pct

ROOT = Path(__file__).resolve().parents[2]
REALRUNS = ROOT.parent / "shared" / "realruns" / "rtx_vllm0190"
# NVIDIA publishes no dense bf16 figure for it: 188 SMs x 1,024 FLOP per clock x 2,430 MHz.
SERVER_EDITION = {"base": "rtxpro6000", "name": "rtxpro6000-server",
                  "memory_bandwidth_bytes_s": 1.597e12, "peak_bf16_flops": 4.678e14,
                  "peak_fp8_flops": 9.356e14}
sys.path.insert(0, str(Path(__file__).parent))
from common import error_cells, median_row, replica_fields, report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--realruns", type=Path, default=REALRUNS)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a replica field for every run, e.g. gpu=rtxpro6000")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args()
    from sim.config.errors import InputError
    from sim.studies.measured import read_engine_run, simulate

    runs = sorted(p.parent for p in args.realruns.glob("*/*/vllm/meta.json"))
    if not runs:
        print(f"{args.realruns}: no run (*/*/vllm/meta.json) there (give --realruns)",
              file=sys.stderr)
        return 2
    replica = replica_fields(args.set)
    stages, sims, skipped = [], [], []
    for run in runs:
        try:
            experiment = read_engine_run(run)
        except InputError as exc:
            skipped.append(f"{'/'.join(run.parts[-3:-1])}: {exc.problem}")
            continue
        variants = [("", replica)]
        if experiment.gpu == "rtxpro6000" and "gpu" not in replica:
            # The edition is not recorded; the Server Edition is the likelier (LLMServingSim's
            # own RTX PRO 6000 profile reads 1,597.6 GB/s): both are shown.
            variants.append((" (Server Edition)", {**replica, "gpu": SERVER_EDITION}))
        for label, fields in variants:
            try:
                got = simulate((experiment, fields))
            except InputError as exc:
                print(exc, file=sys.stderr)
                return 2
            stages += [dataclasses.replace(s, name=s.name + label) for s in experiment.stages]
            sims += got
    errors = errors_pct(stages, sims, np.zeros(len(stages)))
    lines = ["servesim vs vLLM 0.19.0 on RTX GPUs, engine-side: (servesim - measured) / "
             "measured, %" + (f"; --set {' '.join(args.set)}" if args.set else ""), "",
             "| run | " + " | ".join(name for name, *_ in METRICS) + " | servesim overloaded |",
             "|---|" + "---:|" * len(METRICS) + "---|"]
    for stage, sim, row in zip(stages, sims, errors, strict=True):
        lines.append(f"| {stage.name} | {error_cells(row)} | "
                     f"{'yes' if sim['overloaded'] else 'no'} |")
    server = [s.name.endswith("(Server Edition)") for s in stages]
    has_server = {s.name.removesuffix(" (Server Edition)") for s, on in zip(stages, server,
                                                                          strict=True) if on}
    for title, keep in (("Workstation Edition figures", [not on for on in server]),
                        ("Server Edition figures", [on or s.name not in has_server
                                                    for s, on in zip(stages, server,
                                                                     strict=True)])):
        lines.append(median_row(f"median abs, RTX PRO 6000 at {title}",
                                [e for e, k in zip(errors, keep, strict=True) if k]))
    lines += [f"| {line} |" + " |" * (len(METRICS) + 1) for line in skipped]
    report("\n".join(lines), args.out, "rtx_vllm0190.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
