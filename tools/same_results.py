"""Every result file of the shipped scenarios and benchmark cases, written by this checkout, and
a byte-for-byte comparison of two such sets: the check that a refactoring changed no result.

    python tools/same_results.py run /tmp/before      # in the checkout before
    python tools/same_results.py run /tmp/after       # in the checkout after
    python tools/same_results.py diff /tmp/before /tmp/after

`run` runs, each in a fresh process of this checkout's `sim`: the embedded default scenario
(`servesim simulate`), every `scenarios/*.yaml` with the command its kind takes (`compare_*`:
compare, `sweep_*`: sweep, `validate_*`: left out, as they replay real torch runs in real
time), and `bench/vidur_1k.yaml`, `bench/vidur_10k.yaml`, `bench/sweep_16.yaml`. `diff` lists
files only in one set and files whose bytes differ, and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cases() -> list[tuple[str, list[str]]]:
    """(name, servesim arguments but --out) for every case."""
    out: list[tuple[str, list[str]]] = [("default", ["simulate"])]
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        name = path.stem
        if name.startswith("validate_"):
            continue
        command = ("compare" if name.startswith("compare_") else
                   "sweep" if name.startswith("sweep_") else "simulate")
        out.append((name, [command, str(path)]))
    out += [("bench_vidur_1k", ["simulate", str(ROOT / "bench" / "vidur_1k.yaml")]),
            ("bench_vidur_10k", ["simulate", str(ROOT / "bench" / "vidur_10k.yaml")]),
            ("bench_sweep_16", ["sweep", str(ROOT / "bench" / "sweep_16.yaml")])]
    return out


def run(out_dir: Path, only: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, args in cases():
        if only and name not in only:
            continue
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "sim", *args, "--out",
                               str(out_dir / name)], cwd=ROOT, capture_output=True, text=True)
        print(f"{name}: exit {proc.returncode}, {time.perf_counter() - start:.0f} s", flush=True)
        if proc.returncode:
            print(proc.stderr[-2000:], flush=True)


def diff(a: Path, b: Path) -> int:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    problems = [f"only in {a}: {p}" for p in sorted(files_a - files_b)]
    problems += [f"only in {b}: {p}" for p in sorted(files_b - files_a)]
    problems += [f"differs: {p}" for p in sorted(files_a & files_b)
                 if not filecmp.cmp(a / p, b / p, shallow=False)]
    print("\n".join(problems) if problems else
          f"identical: {len(files_a)} files, byte for byte")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("out", type=Path)
    p_run.add_argument("only", nargs="*", help="cases (default: all)")
    p_diff = sub.add_parser("diff")
    p_diff.add_argument("a", type=Path)
    p_diff.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.only)
        return 0
    return diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
