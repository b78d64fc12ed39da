"""servesim against Vidur's quoted times (issue 14): `servesim simulate` of bench/vidur_1k.yaml
and bench/vidur_10k.yaml as whole processes, pinned to one core (`taskset -c 0`; without
taskset, unpinned, and the table says so), N runs each, the two cases alternated.

Vidur 0.0.26 (lean outputs) was measured 2026-11 on the project's 2-core VMs, runs alternated,
whole process, median of 3: 1,000 requests 7.5-11.4 s, 10,000 requests 45-57 s (CPU 30-32 s).
Vidur is not installed here: its numbers are the quoted ones. The speed-up divides the midpoint
of Vidur's quoted range ((7.5 + 11.4) / 2 = 9.45 s; (45 + 57) / 2 = 51 s) by servesim's median
wall time. Targets: <= 0.25 s and <= 1.0 s whole process.

Each case runs once untimed first (file cache). Where PYTHONDONTWRITEBYTECODE is set (as on the
development VMs), sim's own modules are compiled from source on every run (about 0.2 s);
--pyc measures with a bytecode cache instead (in a temporary directory), as after `pip
install` and any first run. --checkout DIR times another checkout's `sim` (say, an older
commit from `git worktree add`) through the same entry point, as bench/startup.py does.

    python bench/vidur_compare.py [--runs 5] [--no-taskset] [--pyc] [--checkout DIR]
    python bench/vidur_compare.py --profile    # cProfile of vidur_10k through run_scenario
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent
console = Console(width=170)


@dataclass
class Case:
    name: str
    scenario: Path
    vidur_s: tuple[float, float]  # quoted range, whole process
    target_s: float
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)

    @property
    def vidur_mid_s(self) -> float:
        return sum(self.vidur_s) / 2


CASES = (
    Case("1,000 requests", BENCH / "vidur_1k.yaml", (7.5, 11.4), 0.25),
    Case("10,000 requests", BENCH / "vidur_10k.yaml", (45.0, 57.0), 1.0),
)


def servesim_exe() -> str:
    """The venv's servesim beside this interpreter, else the one on PATH."""
    here = Path(sys.executable).with_name("servesim")
    return str(here) if here.exists() else (shutil.which("servesim") or "servesim")


# What the `servesim` script runs, for a checkout that is not the installed one.
ENTRY = "import sys; sys.argv[0] = 'servesim'; from sim.cli import main; main()"


def run_once(cmd: list[str], env: dict[str, str], cwd: Path | None = None
             ) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (MB) of one whole process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def profile(scenario: Path, top: int) -> None:
    """cProfile of one in-process `run_scenario` of `scenario` (no result files): the `top`
    functions by own time."""
    import cProfile
    import pstats

    from sim import run_scenario
    from sim.config.scenario import load_scenario

    loaded = load_scenario(scenario)
    t0 = time.perf_counter()
    run_scenario(loaded)  # warm: lazy imports and caches out of the profile
    console.print(f"unprofiled run_scenario({scenario.name}): {time.perf_counter() - t0:.2f} s")
    prof = cProfile.Profile()
    prof.enable()
    run_scenario(loaded)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per case (alternated)")
    parser.add_argument("--no-taskset", action="store_true", help="do not pin to core 0")
    parser.add_argument("--profile", action="store_true",
                        help="instead: cProfile one in-process run of vidur_10k.yaml")
    parser.add_argument("--top", type=int, default=20, help="functions shown by --profile")
    parser.add_argument("--pyc", action="store_true",
                        help="with a bytecode cache, even where PYTHONDONTWRITEBYTECODE is set")
    parser.add_argument("--checkout", type=Path, default=None,
                        help="time this checkout's sim instead of the installed one")
    args = parser.parse_args()
    if args.profile:
        profile(CASES[1].scenario, args.top)
        return
    pin = [] if args.no_taskset or shutil.which("taskset") is None else ["taskset", "-c", "0"]
    if args.checkout is None:
        exe, cwd = [servesim_exe()], None
        where_sim = subprocess.run([sys.executable, "-c", "import sim; print(sim.__file__)"],
                                   capture_output=True, text=True, cwd=tempfile.gettempdir()
                                   ).stdout.strip()
    else:
        exe, cwd = [sys.executable, "-c", ENTRY], args.checkout.resolve()
        where_sim = str(cwd / "sim")
    console.print(f"servesim: {' '.join(exe)} (sim package: {where_sim})", highlight=False)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="vidur_compare-") as tmp:
        if args.pyc:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        for i in range(-1, args.runs):  # run -1: untimed, to warm the caches
            for case in CASES:
                out = Path(tmp) / f"{case.scenario.stem}-{i}"
                wall, cpu, rss = run_once([*pin, *exe, "simulate", str(case.scenario),
                                           "--out", str(out)], env, cwd)
                if i < 0:
                    continue
                case.walls.append(wall)
                case.cpus.append(cpu)
                case.rss_mb.append(rss)
                console.print(f"run {i + 1}/{args.runs} {case.name}: {wall:.2f} s wall, "
                              f"{cpu:.2f} s CPU", highlight=False)
    where = "one core (taskset -c 0)" if pin else "unpinned (no taskset)"
    bytecode = ("cached" if "PYTHONDONTWRITEBYTECODE" not in env
                else "none: sim compiled from source each run")
    table = Table(title=f"servesim simulate vs Vidur 0.0.26 (quoted), whole process, {where}, "
                        f"{args.runs} runs alternated; bytecode {bytecode}")
    for col in ("case", "wall s best", "wall s median", "CPU s median", "peak RSS MB",
                "Vidur quoted s", "speed-up vs Vidur mid", "target s", "met (median)"):
        table.add_column(col, justify="right")
    for case in CASES:
        med = median(case.walls)
        lo, hi = case.vidur_s
        met = "[green]yes[/]" if med <= case.target_s else "[red]no[/]"
        table.add_row(case.name, f"{min(case.walls):.2f}", f"{med:.2f}",
                      f"{median(case.cpus):.2f}", f"{max(case.rss_mb):.0f}",
                      f"{lo:g}-{hi:g}", f"{case.vidur_mid_s / med:.1f}x "
                      f"({case.vidur_mid_s:g} / {med:.2f})", f"<= {case.target_s:g}", met)
    table.caption = ("speed-up = midpoint of Vidur's quoted range / servesim's median wall; "
                     "Vidur CPU for 10k: 30-32 s (quoted)")
    console.print(table)


if __name__ == "__main__":
    main()
