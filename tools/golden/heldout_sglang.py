"""Random held-out SGLang workloads, recorded with the installed SGLang, for checking servesim on
workloads its rules were not developed against (not committed as fixtures).

    ~/venv-sglang/bin/python tools/golden/heldout_sglang.py --out /tmp/heldout 0 1 2 ...
    .venv/bin/python -m tools.golden.replay /tmp/heldout/sglang-*/*.json.gz

Each seed draws 40 requests (shared prefixes mostly, else Poisson or bursts, outputs from one
token), a chunk size, `max_running_requests`, the radix cache (on for 3 in 4), the overlap loop
(on for 1 in 2), a token pool of 1.2-6 times the largest request, and a step time. Each seed is
recorded in a fresh process (SGLang's server arguments are process-wide), 5-120 s each on a
quiet machine. On 2026-11-29 with SGLang 0.5.23, seeds 0-47: 47 of 47 recorded identical (seed 37
did not finish recording within 15 minutes on a loaded machine), after two latch rules they
found were fixed.

With `--hicache`, each also gets the hierarchical cache (the radix cache on, a GPU pool of
1.2-3 times the largest request, a host pool 1.5, 2 or 4 times it, either write policy,
copies timed at 1, 5 or 25 GB/s: `hicache_transfer` "bandwidth"), outputs sampled, from a
generator of its own. On 2026-12-01, seeds 0-44: 45 of 45 identical (17 loaded prefixes
back from host memory: 67 loads of 56k tokens; 410k tokens evicted from host pools).

With `--page-size N` SGLang runs on pages of N tokens (`random`: 4, 16 or 64, from a generator
of its own), the pool rounded up to whole pages (not with `--hicache`: servesim refuses
HiCache on pages of more than one token). On 2026-12-01, `--page-size random`, seeds 0-26
and 30-54: 52 of 52 identical (22 on pages of 64, 13 of 16, 17 of 4; seeds 27-29 and 55-59
not recorded in the time given).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.golden import workloads as W  # noqa: E402
from tools.golden.workloads_sglang import _sglang  # noqa: E402


def make(seed: int, hicache: bool = False, page_size: int | str = 1) -> dict[str, Any]:
    """Seed `seed`'s workload; `page_size` SGLang's `--page-size` ("random": 4, 16 or 64
    from a generator of its own), its pool then rounded up to whole pages."""
    rng = np.random.default_rng(2000 + seed)
    n = 40
    kind = seed % 4
    if kind == 0:
        reqs = W._requests(rng, n, float(rng.uniform(2, 30)),
                           (int(rng.integers(16, 300)), int(rng.integers(300, 3000))),
                           (1, int(rng.integers(2, 200))))
    elif kind == 1:
        reqs = W._bursts(rng, n, (1, int(rng.integers(2, 10))), (0.05, 1.0),
                         (16, int(rng.integers(200, 3000))), (1, int(rng.integers(2, 200))))
    else:
        reqs = W._prefixed(rng, n, float(rng.uniform(2, 30)), int(rng.integers(1, 8)),
                           (16, 1500), (1, 600), (1, int(rng.integers(2, 200))))
    largest = max(r[1] + r[2] for r in reqs)
    settings = dict(chunked_prefill_size=int(rng.choice([256, 512, 1024, 2048, 8192])),
                    max_running_requests=int(rng.choice([4, 16, 256])),
                    disable_radix_cache=bool(rng.random() < 0.25),
                    disable_overlap_schedule=bool(rng.random() < 0.5))
    tokens = int(largest * float(rng.uniform(1.2, 6.0))) + 16
    step = (float(rng.choice([0.002, 0.01])), float(rng.choice([0.0, 1e-5, 5e-5])))
    if hicache:
        # (from a generator of its own: the rest is the seed's workload as without it)
        tier_rng = np.random.default_rng(9000 + seed)
        tokens = int(largest * float(tier_rng.uniform(1.2, 3.0))) + 16  # (a GPU that evicts)
        settings.update(
            disable_radix_cache=False, enable_hierarchical_cache=True,
            hicache_ratio=float(tier_rng.choice([1.5, 2.0, 4.0])),
            hicache_write_policy=str(tier_rng.choice(["write_through",
                                                      "write_through_selective"])),
            hicache_transfer="bandwidth",
            hicache_host_bandwidth_gb_s=float(tier_rng.choice([1.0, 5.0, 25.0])),
            temperature=1.0)  # (sampled: a repeated prompt's outputs its own)
    if page_size == "random":
        page_size = int(np.random.default_rng(7000 + seed).choice([4, 16, 64]))
    assert isinstance(page_size, int) and not (hicache and page_size > 1), page_size
    tokens = -(-tokens // page_size) * page_size
    return _sglang(f"heldout_{seed}", 2000 + seed, reqs, num_gpu_blocks=tokens, step=step,
                   page_size=page_size, **settings)


def _record_one(out: Path, seed: int, hicache: bool = False, page_size: str = "1") -> None:
    from tools.golden.record_sglang import record_fixture

    page: int | str = page_size if page_size == "random" else int(page_size)
    record_fixture(out, make(seed, hicache, page), "python tools/golden/heldout_sglang.py "
                   f"--out DIR {'--hicache ' if hicache else ''}"
                   f"{f'--page-size {page_size} ' if page != 1 else ''}{seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--in-process", action="store_true",
                        help="record one seed in this process (used per seed)")
    parser.add_argument("--hicache", action="store_true",
                        help="the radix cache with the hierarchical cache (its copies timed "
                             "at a host link's rate), a GPU pool that evicts, sampled outputs")
    parser.add_argument("--page-size", default="1",
                        help="SGLang's --page-size: tokens, or 'random' (4, 16 or 64 a seed)")
    parser.add_argument("seeds", type=int, nargs="+")
    args = parser.parse_args()
    if args.in_process:
        assert len(args.seeds) == 1, "--in-process records one seed"
        _record_one(args.out, args.seeds[0], args.hicache, args.page_size)
        return
    for seed in args.seeds:
        try:
            subprocess.run([sys.executable, __file__, "--out", str(args.out), "--in-process",
                            *(["--hicache"] if args.hicache else []),
                            "--page-size", args.page_size, str(seed)],
                           check=False, timeout=900)
        except subprocess.TimeoutExpired:
            print(f"{seed}: not recorded in 15 minutes (skipped)", flush=True)


if __name__ == "__main__":
    main()
