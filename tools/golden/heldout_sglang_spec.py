"""Random held-out SGLang speculative-decoding workloads, recorded with the installed SGLang, for
checking servesim's speculative rules on workloads they were not developed against (not
committed as fixtures).

    ~/venv-sglang/bin/python tools/golden/heldout_sglang_spec.py --out /tmp/heldout_spec 0 1 2 ...
    .venv/bin/python -m tools.golden.replay /tmp/heldout_spec/sglang-*/*.json.gz

Each seed draws 20-50 requests (Poisson or bursts; prompts 16-512 tokens, outputs from one
token up to 64), the algorithm (EAGLE, EAGLE3, NGRAM, STANDALONE), its numbers (S, K, D) (K 1:
D = S + 1; K 2-3: D in [S + 1, K + (S - 1) K^2 + 1], from 2 for NGRAM; for 1 seed in 5 left to
SGLang, as `settings.unset`), an acceptance rate of 0, 0.3, 0.7 or 1, the overlap loop (on for
1 in 2), a chunk size of 32-1024, `max_running_requests` (for 1 in 4 left to SGLang: 48), a
token pool of 1.05-4 times the largest request (prompt + output; 1.05 + 2.95 u^3, half of
them below 1.42), so that requests are often retracted and sometimes aborted, and a step time.
Pages are one token. The radix cache is on for about 1 seed in 2 (a draw of its own,
`radix_drawn`; `--radix-cache on|off` overrides it): the requests then share one of 1-6
system prompts (Zipf-like, 16 to 32-448 tokens, plus 1 to 8-128 tokens of their own, Poisson
arrivals), drawn from a generator of their own, and everything else is drawn as with the radix
cache off (the requests those draws would give are drawn and set aside), so a seed drawing it
off is the same workload as before the radix cache was drawn. Each seed is recorded by
`record_sglang_spec.record` in a fresh process (SGLang's server arguments are process-wide),
5-170 s each; a seed not recorded within `--timeout` seconds (180 by default) is skipped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.golden import workloads as W  # noqa: E402
from tools.golden.workloads_sglang import SPEC_UNSETTABLE, _sglang_spec  # noqa: E402

ALGORITHMS = ("EAGLE", "EAGLE3", "NGRAM", "STANDALONE")
# SGLang's own (S, K, D) when none is given (`arg_groups/speculative_hook.py`): a Llama target's
# for the EAGLE family (`_auto_choose_speculative_params`), a standalone draft's, NGRAM's
# (`_handle_ngram`: breadth 10, 12 tokens, S = 12 // 10).
SGLANG_AUTO = {"EAGLE": (5, 4, 8), "EAGLE3": (5, 4, 8), "STANDALONE": (3, 1, 4),
               "NGRAM": (1, 10, 12)}


def _numbers(rng: np.random.Generator, algorithm: str) -> tuple[int, int, int, bool]:
    """(S, K, D, left to SGLang). A tree (K > 1) of the EAGLE family verifies at least S + 1
    tokens: with fewer, SGLang 0.5.23 fails in the verify (`_compact_accept_to_front`,
    `speculative/eagle_worker_common.py`:543, writes the S + 1 accepted-path rows into a block
    of D)."""
    if rng.random() < 0.2:
        return (*SGLANG_AUTO[algorithm], True)
    steps = int(rng.integers(1, 6))
    topk = int(rng.choice([1, 1, 2, 3]))
    if topk == 1:
        return steps, 1, steps + 1, False
    low = 2 if algorithm == "NGRAM" else steps + 1
    return steps, topk, int(rng.integers(low, topk + (steps - 1) * topk * topk + 2)), False


def radix_drawn(seed: int) -> bool:
    """Whether seed `seed` has the radix cache on (1 in 2), a draw apart from the rest."""
    return bool(np.random.default_rng([3000 + seed, 1]).random() < 0.5)


def _shared_prefix_requests(seed: int, n: int, output: tuple[int, int]) -> list[list[Any]]:
    """The radix cache's requests: shared system prompts, from a generator of their own."""
    rng = np.random.default_rng([3000 + seed, 2])
    num_groups = int(rng.integers(1, 7))
    prefix = (16, int(rng.integers(32, 449)))
    suffix = (1, int(rng.integers(8, 129)))
    return W._prefixed(rng, n, float(rng.uniform(2, 200)), num_groups, prefix, suffix, output)


def make(seed: int, radix: bool | None = None) -> dict[str, Any]:
    """Seed `seed`'s workload; `radix` (default: `radix_drawn(seed)`) turns the radix cache
    on, with shared-prefix requests in place of those drawn otherwise."""
    radix = radix_drawn(seed) if radix is None else radix
    rng = np.random.default_rng(3000 + seed)
    n = int(rng.integers(20, 51))
    algorithm = str(rng.choice(ALGORITHMS))
    steps, topk, draft, auto = _numbers(rng, algorithm)
    prompt = (16, int(rng.integers(32, 513)))
    output = (1, int(rng.integers(1, 65)))
    if rng.random() < 0.5:
        reqs = W._requests(rng, n, float(rng.uniform(2, 200)), prompt, output)
    else:
        reqs = W._bursts(rng, n, (1, int(rng.integers(2, 12))), (0.02, 1.0), prompt, output)
    if radix:  # (the requests above drawn all the same: the draws below are unchanged)
        reqs = _shared_prefix_requests(seed, n, output)
    largest = max(r[1] + r[2] for r in reqs)
    # 1.05-4 times, mostly tight (median 1.42): a request alone may then not fit its decode
    # top-up (`retract_decode` aborts it).
    tokens = int(largest * (1.05 + 2.95 * float(rng.random()) ** 3))
    unset = tuple(SPEC_UNSETTABLE[1:]) if auto else ()
    if rng.random() < 0.25:
        unset, max_running = (*unset, SPEC_UNSETTABLE[0]), 48
    else:
        max_running = int(rng.choice([2, 4, 8, 16, 32, 64]))
    step = (float(rng.choice([0.002, 0.01])), float(rng.choice([0.0, 1e-5, 5e-5])))
    suffix = "" if radix == radix_drawn(seed) else ("_radix" if radix else "_no_radix")
    return _sglang_spec(
        f"heldout_spec_{seed}{suffix}", 3000 + seed, reqs, algorithm=algorithm, num_steps=steps,
        eagle_topk=topk, num_draft_tokens=draft,
        acceptance_rate=float(rng.choice([0.0, 0.3, 0.7, 1.0])), unset=unset,
        num_gpu_blocks=tokens, step=step,
        chunked_prefill_size=int(rng.integers(32, 1025)), max_running_requests=max_running,
        disable_radix_cache=not radix, disable_overlap_schedule=bool(rng.random() < 0.5))


RADIX_CHOICES = {"drawn": None, "on": True, "off": False}


def _record_one(out: Path, seed: int, radix_cache: str = "drawn") -> None:
    import sglang

    from tools.golden.fixture import write_fixture
    from tools.golden.record_sglang_spec import record, summary

    wall = time.monotonic()
    workload = make(seed, RADIX_CHOICES[radix_cache])
    body = record(workload)
    option = "" if radix_cache == "drawn" else f" --radix-cache {radix_cache}"
    path = write_fixture(out, workload, body, engine="sglang", engine_version=sglang.__version__,
                         command=f"python tools/golden/heldout_sglang_spec.py --out DIR"
                                 f"{option} {seed}")
    radix = "radix on" if not workload["settings"]["disable_radix_cache"] else "radix off"
    print(f"{seed} ({radix}): {summary(body)}, {time.monotonic() - wall:.0f} s -> {path}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds a seed may take to record before it is skipped")
    parser.add_argument("--in-process", action="store_true",
                        help="record one seed in this process (used per seed)")
    parser.add_argument("--radix-cache", choices=sorted(RADIX_CHOICES), default="drawn",
                        help="the radix cache as each seed draws it (default), or on / off")
    parser.add_argument("--only-radix", action="store_true",
                        help="record only the seeds whose workload has the radix cache on")
    parser.add_argument("seeds", type=int, nargs="+")
    args = parser.parse_args()
    if args.in_process:
        assert len(args.seeds) == 1, "--in-process records one seed"
        _record_one(args.out, args.seeds[0], args.radix_cache)
        return
    for seed in args.seeds:
        if args.only_radix and make(seed, RADIX_CHOICES[args.radix_cache])["settings"][
                "disable_radix_cache"]:
            continue
        try:
            done = subprocess.run([sys.executable, __file__, "--out", str(args.out),
                                   "--radix-cache", args.radix_cache, "--in-process",
                                   str(seed)], check=False, timeout=args.timeout)
            if done.returncode:
                print(f"{seed}: recording failed (exit {done.returncode})", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{seed}: not recorded in {args.timeout:.0f} s (skipped)", flush=True)


if __name__ == "__main__":
    main()
