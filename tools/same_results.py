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
import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

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


CHECKOUT_FILE = ".checkout"  # in a set: the checkout that wrote it
CODE = re.compile(r"\b\d+\.\d+\.\d+\+[0-9a-f]{16}\b")


def run(out_dir: Path, only: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CHECKOUT_FILE).write_text(str(ROOT))
    for name, args in cases():
        if only and name not in only:
            continue
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "sim", *args, "--out",
                               str(out_dir / name)], cwd=ROOT, capture_output=True, text=True)
        print(f"{name}: exit {proc.returncode}, {time.perf_counter() - start:.0f} s", flush=True)
        if proc.returncode:
            print(proc.stderr[-2000:], flush=True)


class Side:
    """One set of results, read with what must differ between checkouts taken out."""

    def __init__(self, top: Path) -> None:
        self.top = top
        marker = top / CHECKOUT_FILE
        self.root = marker.read_text().strip() if marker.is_file() else None
        # A sweep point's key -> its resolved scenario's hash (the same point in both sets).
        self.keys: dict[str, str] = {}
        for scenario in top.glob("*/runs/*/scenario.yaml"):
            text = self.text(scenario.read_text())
            self.keys[scenario.parent.name] = hashlib.sha256(text.encode()).hexdigest()[:16]

    def text(self, text: str) -> str:
        text = CODE.sub("<code>", text)
        if self.root:
            text = text.replace(self.root, "<checkout>")
        for key, point in getattr(self, "keys", {}).items():
            text = text.replace(key, f"<point {point}>")
        return text

    def files(self) -> dict[str, Path]:
        out = {}
        for path in self.top.rglob("*"):
            if path.is_file() and path.name != CHECKOUT_FILE:
                out[self.text(path.relative_to(self.top).as_posix())] = path
        return out

    def table(self, path: Path) -> pd.DataFrame:
        frame = pd.read_parquet(path)
        for column in frame.columns:
            if not pd.api.types.is_numeric_dtype(frame[column]):
                frame[column] = frame[column].map(
                    lambda v: self.text(v) if isinstance(v, str) else v)
        return frame


def same(a: Side, b: Side, path_a: Path, path_b: Path) -> bool:
    bytes_a, bytes_b = path_a.read_bytes(), path_b.read_bytes()
    if bytes_a == bytes_b:
        return True
    if path_a.suffix == ".parquet":
        return a.table(path_a).equals(b.table(path_b))
    try:
        return a.text(bytes_a.decode()) == b.text(bytes_b.decode())
    except UnicodeDecodeError:
        return False


def diff(a_dir: Path, b_dir: Path) -> int:
    a, b = Side(a_dir), Side(b_dir)
    files_a, files_b = a.files(), b.files()
    problems = [f"only in {a_dir}: {p}" for p in sorted(files_a.keys() - files_b.keys())]
    problems += [f"only in {b_dir}: {p}" for p in sorted(files_b.keys() - files_a.keys())]
    num_bytes = 0
    for name in sorted(files_a.keys() & files_b.keys()):
        if files_a[name].read_bytes() == files_b[name].read_bytes():
            num_bytes += 1
        elif not same(a, b, files_a[name], files_b[name]):
            problems.append(f"differs: {name}")
    print("\n".join(problems) if problems else
          f"identical: {len(files_a)} files ({num_bytes} byte for byte, the rest but for the "
          "code's fingerprint, the checkout's path and sweep keys)")
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
