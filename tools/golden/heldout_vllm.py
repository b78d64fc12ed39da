"""Random held-out vLLM workloads, recorded with the installed vLLM, for checking servesim on
workloads its rules were not developed against (not committed as fixtures).

    ~/venv-vllm/bin/python tools/golden/heldout_vllm.py --out /tmp/heldout 0 1 2 ...
    .venv/bin/python -m tools.golden.replay /tmp/heldout/vllm-*/*.json.gz

Each seed draws 120 requests (Poisson, bursts, or shared prefixes), a budget, `max_num_seqs`,
chunking, threshold, prefix caching, async scheduling, a KV size (300-20,000 blocks) and a step
time. On 2026-11-29, seeds 0-59 with vLLM 0.15.1 and 0.33.0: 120 of 120 identical.

With `--ngram`, each also gets n-gram speculative decoding (k, acceptance, and lookups that
miss: `match_rate`), drawn from a generator of its own, so that the rest is the seed's
workload as without it; async only where the release allows it with n-gram (0.33.0).
With `--arc` (0.33.0), prefix caching and a CPU tier under ARC, its size (a tenth of the GPU
blocks to twice them), copy rate and `store_threshold` (0, 2 or 3) from a generator of its
own. On 2026-12-01, seeds 0-159: 160 of 160 identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.golden import workloads as W  # noqa: E402
from tools.golden.fixture import write_fixture  # noqa: E402


def make(seed: int, ngram: bool = False, version: str = "0.33.0", arc: bool = False
         ) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + seed)
    n = 120
    kind = seed % 3
    if kind == 0:
        reqs = W._requests(rng, n, float(rng.uniform(2, 30)),
                           (int(rng.integers(16, 600)), int(rng.integers(600, 6000))),
                           (1, int(rng.integers(2, 300))))
    elif kind == 1:
        reqs = W._bursts(rng, n, (1, int(rng.integers(2, 12))), (0.05, 2.0),
                         (16, int(rng.integers(200, 5000))), (1, int(rng.integers(2, 200))))
    else:
        reqs = W._prefixed(rng, n, float(rng.uniform(2, 30)), int(rng.integers(1, 8)),
                           (16, 2000), (1, 800), (1, 200))
    budget = int(rng.choice([512, 1024, 2048, 4096, 8192]))
    chunk = bool(rng.random() < 0.8)
    settings = dict(max_num_batched_tokens=budget if chunk else 8192,
                    max_num_seqs=int(rng.choice([4, 16, 64, 256])),
                    enable_chunked_prefill=chunk,
                    long_prefill_token_threshold=int(rng.choice([0, 0, 128, 512])) if chunk
                    else 0,
                    enable_prefix_caching=bool(rng.random() < 0.5),
                    async_scheduling=bool(rng.random() < 0.6))
    settings["max_num_seqs"] = min(settings["max_num_seqs"], settings["max_num_batched_tokens"])
    blocks = int(rng.choice([300, 600, 2000, 20000]))
    step = (float(rng.choice([0.002, 0.01])), float(rng.choice([0.0, 1e-5, 5e-5])))
    max_model_len = 32768 if chunk else 8192
    for r in reqs:
        r[1] = min(r[1], max_model_len - r[2] - 1)
    if ngram:
        spec_rng = np.random.default_rng(5000 + seed)
        settings["speculative"] = W._spec(
            "ngram", int(spec_rng.integers(1, 6)), round(float(spec_rng.uniform(0.2, 0.95)), 3),
            match_rate=round(float(spec_rng.uniform(0.2, 0.95)), 3))
        if version.startswith("0.15."):
            settings["async_scheduling"] = False  # (0.15.1 refuses async with n-gram)
    if arc:
        tier_rng = np.random.default_rng(7000 + seed)
        blocks = min(blocks, 2000)  # (a tier that evicts)
        # (vLLM refuses to start with a max_model_len its KV cache cannot hold: every request
        # fits it, as in the other held-out workloads by their sizes)
        for r in reqs:
            r[1] = max(1, min(r[1], (blocks - 1) * 16 - r[2] - 1))  # (less the null block)
        settings["enable_prefix_caching"] = True
        settings["kv_offload"] = W._offload(
            int(tier_rng.integers(blocks // 10, 2 * blocks)),
            float(tier_rng.choice([0.5, 4.0, 25.0])), "arc",
            store_threshold=int(tier_rng.choice([0, 0, 2, 3])))
    return W._vllm(f"heldout_{seed}", 1000 + seed, reqs, num_gpu_blocks=blocks, step=step,
                   max_model_len=max_model_len, **settings)


def main() -> None:
    import vllm

    from tools.golden.record_vllm import record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ngram", action="store_true",
                        help="n-gram speculative decoding, lookups missing now and then")
    parser.add_argument("--arc", action="store_true",
                        help="prefix caching and a CPU tier under ARC (vLLM 0.33.0)")
    parser.add_argument("seeds", type=int, nargs="+")
    args = parser.parse_args()
    for seed in args.seeds:
        workload = make(seed, args.ngram, vllm.__version__, args.arc)
        body = record(workload)
        path = write_fixture(args.out, workload, body, engine="vllm",
                             engine_version=vllm.__version__,
                             command="python tools/golden/heldout_vllm.py --out DIR "
                                     f"{'--ngram ' if args.ngram else ''}"
                                     f"{'--arc ' if args.arc else ''}{seed}")
        print(f"{seed}: {len(body['steps'])} steps -> {path}")


if __name__ == "__main__":
    main()
