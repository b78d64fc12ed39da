"""The running limit SGLang resolves (`--max-running-requests` unset, or given) for a KV pool
and a context window, read from SGLang's own Scheduler built on a CPU, for
`tests/schedulers/test_sglang_defaults.py` (which holds what this printed).

    python3 tools/golden/check_sglang_defaults.py        # drives ~/venv-sglang, one process a case

Each case builds SGLang's Scheduler in a fresh process (its server arguments are process-wide)
with `--max-total-tokens` the pool and `--context-length` the window, as `record_sglang.py`
does, and prints `sched.max_running_requests`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SGLANG_PYTHON = Path.home() / "venv-sglang" / "bin" / "python"
# (pool tokens, context window, max_running_requests given or 0: unset)
CASES = [(3000, 4096, 0), (20_000, 4096, 0), (2_000_000, 8192, 0), (470_000, 131_072, 0),
         (100_000, 32_768, 0), (300, 4096, 256)]


def resolve(num_tokens: int, context_len: int, given: int) -> int:
    """In the SGLang venv: the Scheduler's resolved running limit."""
    from tools.golden.record_sglang import LLAMA_CONFIG, build_scheduler

    settings = {"chunked_prefill_size": 8192, "max_running_requests": given,
                "disable_radix_cache": True, "schedule_policy": "fcfs",
                "disable_overlap_schedule": True}
    if not given:
        settings["unset"] = ["max_running_requests"]
    workload = {"name": "defaults", "settings": settings, "num_gpu_blocks": num_tokens,
                "block_size": 1, "max_model_len": context_len}
    with tempfile.TemporaryDirectory() as model_dir:
        config = {**LLAMA_CONFIG, "max_position_embeddings": max(context_len, 4096)}
        Path(model_dir, "config.json").write_text(json.dumps(config))
        try:
            sched = build_scheduler(workload, model_dir)
        except AssertionError as exc:  # the recorder's check of the limit: what SGLang chose
            return int(str(exc))
    return int(sched.max_running_requests)


def main() -> None:
    if len(sys.argv) == 4:
        print("RESOLVED", resolve(*map(int, sys.argv[1:])))
        return
    for case in CASES:
        out = subprocess.run([str(SGLANG_PYTHON), __file__, *map(str, case)],
                             capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESOLVED")]
        print(case, lines[-1].split()[1] if lines else out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
