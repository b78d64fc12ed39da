"""Instructions a simulation executes, counted by valgrind: a measure of the hot path's cost
that the VM's noise does not move, for judging a change against the code before it.

Wall and CPU times on these VMs move by 20-40% between runs of the same code (`bench/
sim_speed.py` has taken 3.0 s and 5.2 s minutes apart), more than most single changes to the
hot path gain or lose. Valgrind's callgrind counts every instruction the process executes,
the same to within about 1% run after run, whatever else the machine does. A run
under it is about 40x slower, so the cases are the first few thousand requests of
`bench/sim_speed.py`'s and `bench/cluster_scaling.py`'s workloads, and the count is taken as
the difference between a run of N requests and one of 10 (imports, reading the trace and
building the scenario cancel out).

    python bench/instructions.py [--case azure ...] [--num-requests N]
                                 [--checkout DIR ...] [--record FILE | --against FILE]

Each checkout (default: this one) runs each case; with two or more the table adds each
one's ratio to the first. `--record FILE` keeps one checkout's counts (with its commit, Python
and numpy); `--against FILE` counts that file's cases again and exits 1 where one grew by more
than 3%: `bench/instructions.json` holds the last recorded, so a slower hot path is seen before
it lands (a change of 7c5189f's made SGLang's Azure hour 25% costlier, unseen for two days).
Checkouts run two at a time (one per core: counts do not depend on it). Instructions are not
time: a numpy call's instructions and a Python loop's do not cost
the same per instruction, so confirm a change that moves the count by a few percent against
wall time too (`bench/sim_speed.py`, alternated runs). Needs valgrind (Debian: `valgrind`).

Cases:
- `azure`: the Azure 2023 conversation trace on one Llama-3.1-8B H100 replica, chunked prefill
  with a 512-token budget; `azure_v1`: the same under vLLM v1.
- `colocated4`: the same trace at 4x its rate on 4 replicas (least KV load routing);
  `disagg`: at 4x on 2 prefill + 2 decode replicas (`bench/sim_speed.py`'s clusters).
- `cluster16`: generated requests (Azure conversation lengths) at 14 req/s per replica on 16
  replicas (`bench/cluster_scaling.py`'s case); `cluster16_v1`: the same under vLLM v1, whose
  async stretches the router reads at every arrival (those reads took half its run until
  2026-12-03); `cluster16_sglang`: under SGLang, whose prefill batches cut those stretches
  (and, until 2026-12-03, opened a log row for every running request at each).
- `cluster64`: the Azure trace at 64x its rate on 64 replicas (`bench/cluster_scaling.py`'s
  Azure case), where a router reads 64 replicas at every arrival: the case a regression of
  those reads slowed by 46% unseen for a day (bench/README.md, "At scale and under overload").
- `overload`: the Azure trace at 8x its rate on one replica with chunked prefill
  (`bench/sim_speed.py --overload`): queues never drain, every iteration is stepped with a
  full batch and a prompt's chunk beside its decodes; `overload_sglang`: the same under
  SGLang, whose batches mostly only decode. Where the per-request loops cost most.
- `pipeline4`: the Azure trace on one replica of four pipeline stages with chunked prefill,
  every iteration stepped (no stretches for several stages): the per-token cost of a
  pipeline, what most of a `servesim plan` over pipeline sizes spends.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

# The workloads `bench/sim_speed.py` and `bench/cluster_scaling.py` time.
from cluster_scaling import CONV_LENGTHS, ROUTER, generated  # noqa: E402
from sim_speed import CHUNKED, DEFAULT_TRACE, DISAGGREGATED, REPLICA  # noqa: E402

CASES = ("azure", "azure_v1", "azure_sglang", "colocated4", "disagg", "cluster16", "cluster16_v1",
         "cluster16_sglang", "cluster64", "overload", "overload_sglang", "pipeline4")
BASELINE_REQUESTS = 10


def scenario(case: str, num_requests: int) -> dict[str, Any]:
    """The case's scenario as a mapping (plain data: any checkout's parser reads it)."""
    if case.startswith("cluster16"):
        # (`_v1`: vLLM v1's async stretches, read by the router; `_sglang`: SGLang's too, cut
        # by its prefill batches)
        policy = {"cluster16_v1": "vllm_v1", "cluster16_sglang": "sglang"}.get(case)
        return generated(num_requests, 16, 14.0, CONV_LENGTHS,
                         None if policy is None else {"name": policy})
    data: dict[str, Any] = {
        "name": case, "replica": {**REPLICA, "scheduler": CHUNKED},
        "workload": {"format": "azure", "path": str(DEFAULT_TRACE),
                     "num_requests": num_requests}}
    if case == "azure_v1":
        data["replica"] = {**REPLICA, "scheduler": {"name": "vllm_v1"}}
    elif case == "azure_sglang":
        data["replica"] = {**REPLICA, "scheduler": {"name": "sglang"}}
    elif case == "colocated4":
        data["workload"]["rate_scale"] = 4.0
        data["cluster"] = {"replicas": 4, "router": ROUTER}
    elif case == "disagg":
        data["workload"]["rate_scale"] = 4.0
        data["cluster"] = DISAGGREGATED
    elif case == "cluster64":
        data["workload"]["rate_scale"] = 64.0
        data["cluster"] = {"replicas": 64, "router": ROUTER}
    elif case == "pipeline4":
        data["replica"] = {**REPLICA, "scheduler": CHUNKED, "parallelism": {"pipeline": 4}}
    elif case.startswith("overload"):
        data["workload"]["rate_scale"] = 8.0
        if case == "overload_sglang":
            data["replica"] = {**REPLICA, "scheduler": {"name": "sglang"}}
    return data


# Run in the checkout under valgrind: parse and run one scenario, nothing else.
CHILD = """
import json, sys
sys.path.insert(0, ".")
from sim.config.scenario import parse_scenario
from sim.runner import run_scenario
run_scenario(parse_scenario(json.loads(sys.argv[1]), "bench/instructions.py"))
"""


def instructions(checkout: Path, spec: dict[str, Any]) -> int:
    """Instructions callgrind counts for one run of `spec` in `checkout`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
             sys.executable, "-c", CHILD, json.dumps(spec)],
            cwd=checkout, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{checkout}: the run failed:\n{out.stderr[-3000:]}")
    for line in out.stderr.splitlines():
        if "Collected :" in line:
            return int(line.split(":")[-1])
    raise SystemExit(f"{checkout}: no instruction count in valgrind's output")


def compile_modules(checkout: Path) -> None:
    """Write `checkout`'s bytecode, so that no counted run pays for compiling its modules
    (PYTHONDONTWRITEBYTECODE is set on the development VMs)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "sim"], cwd=checkout,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
                   check=True, capture_output=True)


def simulation_instructions(checkout: Path, case: str, num_requests: int) -> int:
    """A run of `num_requests` less one of BASELINE_REQUESTS: the simulation's own cost."""
    return (instructions(checkout, scenario(case, num_requests))
            - instructions(checkout, scenario(case, BASELINE_REQUESTS)))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", choices=CASES, action="append",
                        help="a case (repeatable; default azure and cluster16)")
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--checkout", type=Path, action="append",
                        help="a checkout of servesim (repeatable; default this one)")
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="write the counts (one checkout) to FILE, with the commit and "
                             "the Python and numpy they were counted under")
    parser.add_argument("--against", type=Path, metavar="FILE",
                        help="compare with FILE's counts (its cases by default; exit 1 where "
                             "one grew by more than --tolerance)")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="--against: the growth allowed (default 0.03: counts of one "
                             "checkout repeated within 1%% on 2026-12-03)")
    args = parser.parse_args()
    recorded = json.loads(args.against.read_text()) if args.against else None
    if recorded is not None:
        args.num_requests = recorded["num_requests"]
        args.case = args.case or list(recorded["instructions"])
    if (args.record or args.against) and len(args.checkout or [REPO]) > 1:
        parser.error("--record and --against take one checkout")
    if args.num_requests <= BASELINE_REQUESTS:
        parser.error(f"--num-requests {args.num_requests}: must exceed {BASELINE_REQUESTS}")
    for checkout in args.checkout or []:
        if not (checkout / "sim" / "runner.py").is_file():
            parser.error(f"--checkout {checkout}: not a servesim checkout (no sim/runner.py)")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    cases = args.case or ["azure", "cluster16"]
    checkouts = [c.resolve() for c in (args.checkout or [REPO])]
    for checkout in checkouts:
        compile_modules(checkout)
    jobs = [(case, checkout) for case in cases for checkout in checkouts]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = list(pool.map(
            lambda job: simulation_instructions(job[1], job[0], args.num_requests), jobs))
    result = dict(zip(jobs, counts, strict=True))
    print(f"instructions of the simulation, first {args.num_requests:,} requests "
          f"(less a run of {BASELINE_REQUESTS}), millions:")
    print(f"{'case':<12} {'checkout':<40} {'instructions':>12} {'ratio':>7}")
    for case in cases:
        first = result[(case, checkouts[0])]
        for checkout in checkouts:
            count = result[(case, checkout)]
            print(f"{case:<12} {str(checkout)[-40:]:<40} {count / 1e6:>12,.0f} "
                  f"{count / first:>7.3f}")
    counts_now = {case: result[(case, checkouts[0])] for case in cases}
    if args.record:
        args.record.write_text(json.dumps({**environment(checkouts[0]),
                                           "num_requests": args.num_requests,
                                           "instructions": counts_now}, indent=1) + "\n")
    if recorded is not None:
        raise SystemExit(compare(recorded, counts_now, environment(checkouts[0]),
                                 args.tolerance))


def environment(checkout: Path) -> dict[str, str]:
    """What a count depends on besides the code: the commit, Python and numpy."""
    import numpy as np

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout,
                            capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "python": sys.version.split()[0], "numpy": np.__version__}


def compare(recorded: dict[str, Any], counts: dict[str, int], env: dict[str, str],
            tolerance: float) -> int:
    """Print each case's count against the recorded one; 1 where one grew past `tolerance`
    (counts from another Python or numpy are not comparable: said, and not judged)."""
    print(f"against {recorded['commit']} (Python {recorded['python']}, numpy "
          f"{recorded['numpy']}):")
    if (recorded["python"], recorded["numpy"]) != (env["python"], env["numpy"]):
        print(f"  not comparable: counted here under Python {env['python']}, numpy "
              f"{env['numpy']}")
        return 0
    grew = False
    for case, count in counts.items():
        before = recorded["instructions"].get(case)
        if before is None:
            print(f"  {case:<16} not recorded")
            continue
        ratio = count / before
        flag = "  GREW" if ratio > 1 + tolerance else ""
        grew = grew or bool(flag)
        print(f"  {case:<16} {ratio:7.3f}{flag}")
    return int(grew)


if __name__ == "__main__":
    main()
