"""Sweep scaling with workers (issue 14): the 16-point sweep bench/sweep_16.yaml (about 2 s of
simulation per point) run with 1 and with 2 workers, on local processes and on Ray; wall time
of each whole process and the ratio 1 worker / 2 workers (2.0 = perfect scaling).

- local: `servesim sweep bench/sweep_16.yaml --workers N --force --out TMP`.
- Ray: each Ray case is a child process of this script that starts local Ray with
  `num_cpus=N`, then runs the same sweep through `sim.studies.sweep.run_sweep(..., backend="ray")`
  (whose `ray.init` joins that instance) and shuts Ray down, so that Ray's start and stop are
  reported apart from the sweep (its wall time includes them). With `--ray-cli` the table adds
  the CLI's own `servesim sweep --backend ray` run (every CPU; `--workers N` caps it).

Every run starts from an empty directory (no cached points). Cases are alternated over
`--repeat` rounds; best and median are shown.

    python bench/sweep_scaling.py [--repeat 3] [--skip-ray] [--ray-cli]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent
SWEEP = BENCH / "sweep_16.yaml"
console = Console(width=170)


def servesim_exe() -> str:
    here = Path(sys.executable).with_name("servesim")
    return str(here) if here.exists() else (shutil.which("servesim") or "servesim")


def ray_child(workers: int, out: Path) -> None:
    """Run the sweep on a local Ray instance of `workers` CPUs; print timings as JSON."""
    import logging

    import ray

    from sim.studies.sweep import run_sweep
    from sim.studies.sweep_file import load_sweep

    t0 = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False)
    t1 = time.perf_counter()
    _, runs = load_sweep(SWEEP)
    run_sweep(runs, out, workers=workers, backend="ray", force=True)
    t2 = time.perf_counter()
    ray.shutdown()
    t3 = time.perf_counter()
    print(json.dumps({"ray_init_s": t1 - t0, "sweep_s": t2 - t1, "ray_shutdown_s": t3 - t2}))


def timed(cmd: list[str]) -> tuple[float, float, dict[str, float]]:
    """Wall and CPU seconds (user + system, children included) of one whole process, and the
    JSON line it printed last, if any."""
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    cpu = (after.children_user - before.children_user
           + after.children_system - before.children_system)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    extra = json.loads(last) if last.startswith("{") else {}
    return wall, cpu, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="rounds (cases alternated)")
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--ray-cli", action="store_true",
                        help="also time `servesim sweep --backend ray` (every CPU)")
    parser.add_argument("--ray-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ray_child is not None:
        ray_child(args.ray_child, args.out)
        return

    exe = servesim_exe()
    cases: list[tuple[str, int, list[str]]] = []
    for workers in (1, 2):
        cases.append(("local", workers, [exe, "sweep", str(SWEEP), "--workers", str(workers),
                                         "--force"]))
    if not args.skip_ray:
        for workers in (1, 2):
            cases.append(("ray", workers, [sys.executable, __file__, "--ray-child",
                                           str(workers)]))
        if args.ray_cli:
            cases.append(("ray (CLI, every CPU)", os.cpu_count() or 1,
                          [exe, "sweep", str(SWEEP), "--backend", "ray", "--force"]))
    walls: dict[tuple[str, int], list[float]] = {(b, w): [] for b, w, _ in cases}
    cpus: dict[tuple[str, int], list[float]] = {(b, w): [] for b, w, _ in cases}
    extras: dict[tuple[str, int], list[dict[str, float]]] = {(b, w): [] for b, w, _ in cases}
    with tempfile.TemporaryDirectory(prefix="sweep_scaling-") as tmp:
        for i in range(args.repeat):
            for backend, workers, cmd in cases:
                out = Path(tmp) / f"{backend.split()[0]}-{workers}-{i}"
                wall, cpu, extra = timed([*cmd, "--out", str(out)])
                walls[backend, workers].append(wall)
                cpus[backend, workers].append(cpu)
                extras[backend, workers].append(extra)
                note = (f" (Ray start {extra['ray_init_s']:.1f} s, sweep {extra['sweep_s']:.1f} s,"
                        f" stop {extra['ray_shutdown_s']:.1f} s)" if extra else "")
                console.print(f"round {i + 1}/{args.repeat} {backend}, {workers} worker(s): "
                              f"{wall:.1f} s wall, {cpu:.1f} s CPU{note}", highlight=False)

    table = Table(title=f"16-point sweep ({SWEEP.name}), whole process, {os.cpu_count()} CPUs, "
                        f"{args.repeat} round(s)")
    for col in ("backend", "workers", "wall s best", "wall s median", "CPU s median",
                "Ray start+stop s", "ratio 1w/2w (median)", "ratio 1w/2w (best)"):
        table.add_column(col, justify="right")
    for backend, workers, _ in cases:
        key = (backend, workers)
        ray_overhead = (f"{median(e['ray_init_s'] + e['ray_shutdown_s'] for e in extras[key]):.1f}"
                        if extras[key] and extras[key][0] else "-")
        ratio_med = ratio_best = "-"
        if workers == 2 and (backend, 1) in walls:
            one, two = walls[backend, 1], walls[key]
            ratio_med = f"{median(one) / median(two):.2f}"
            ratio_best = f"{min(one) / min(two):.2f}"
        table.add_row(backend, str(workers), f"{min(walls[key]):.1f}", f"{median(walls[key]):.1f}",
                      f"{median(cpus[key]):.1f}", ray_overhead, ratio_med, ratio_best)
    table.caption = ("ratio = wall with 1 worker / wall with 2 workers (2.0 would be ideal); CPU s "
                     "counts the process and the children it waited for, so not Ray's workers")
    console.print(table)


if __name__ == "__main__":
    main()
