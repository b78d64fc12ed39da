"""Sizing Llama-3.1-70B on eight H100s: TP8 x1, TP4 x2, TP2 x4 and pipelines, under SLOs.

For each variant of `scenarios/compare_llama70b_tp_h100.yaml` (chunked prefill, the Azure 2023
conversation trace), search the largest rate scale at which P99 TBT <= 100 ms and P90 TTFT <=
2 s hold (`sim.studies.capacity`, the same search as `servesim capacity`), then report capacity in
requests/s, per GPU, the cost per million tokens at that rate, and the latencies there.

    python bench/tp_sizing.py [--precision 0.05] [--markdown]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim.runner import run_scenario  # noqa: E402
from sim.studies.capacity import capacity  # noqa: E402
from sim.studies.compare import load_comparison  # noqa: E402
from sim.studies.rate_decision import SLOTargets  # noqa: E402
from sim.workloads.load import with_rate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", type=Path,
                        default=REPO / "scenarios" / "compare_llama70b_tp_h100.yaml")
    parser.add_argument("--precision", type=float, default=0.05)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    targets = SLOTargets(tbt_p99_s=0.1, ttft_p90_s=2.0)
    rows = []
    for name, scenario in load_comparison(args.file).items():
        start = time.perf_counter()
        # A replayed trace with no noise is deterministic: one run per rate decides.
        result = capacity(scenario, targets, precision=args.precision)
        at = run_scenario(with_rate(scenario, result["highest_held"], scenario.seed)).summary
        rows.append((name, result, at, time.perf_counter() - start))
    head = ("variant", "GPUs", "rate scale", "req/s", "req/s/GPU", "$/M tokens",
            "$/M output", "P90 TTFT s", "P99 TBT ms", "runs")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|---|" + "---:|" * (len(head) - 1))
    else:
        print("  ".join(f"{h:>11}" for h in head))
    for name, result, at, _ in rows:
        cells = (name, str(result["num_gpus"]), f"{result['capacity']:.3g}",
                 f"{result['capacity_qps']:.3g}", f"{result['capacity_qps_per_gpu']:.3g}",
                 f"{result['usd_per_million_tokens']:.3g}",
                 f"{result['usd_per_million_output_tokens']:.3g}",
                 f"{at['ttft_s']['p90']:.3g}", f"{1e3 * at['tbt_s']['p99']:.3g}",
                 str(result["num_runs"]))
        if args.markdown:
            print("| " + " | ".join(cells) + " |")
        else:
            print("  ".join(f"{c:>11}" for c in cells))
    print(f"searched in {sum(r[-1] for r in rows):.0f} s; SLOs P99 TBT <= 0.1 s, "
          "P90 TTFT <= 2 s; prices: sim/hardware/gpus.py")


if __name__ == "__main__":
    main()
