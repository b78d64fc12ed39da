"""servesim against public measurements of real vLLM v0.15.1 on H100-SXM: every load stage of
`../shared/realruns/h100_vllm0151/runs.csv` simulated as recorded, and the error table.

    python validation/public/h100_vllm0151.py [--realruns DIR] [--stage NAME ...]
        [--set FIELD=VALUE ...] [--out FILE.md] [--jobs N]

Each stage is simulated on its own, with the engine settings the runs recorded (vLLM v1
`0.15.1`, budget 2,048, 128 sequences, chunked prefill, prefix caching on 16-token blocks, KV
at 0.9 of memory) and the workload as inference-perf's client sent it (`shared_prefix`: 10
groups x 10 prompts cycled, `max_tokens` generated, the stage's rate and duration). Prompt
lengths are the client tokenizer's mean (caveat 3 of the data's README). Nothing is fitted
per run: `--set` changes a replica field for every stage (e.g. `latency.overhead_s=0`).

Compared (servesim minus measured, over measured): TPOT mean and P50, TTFT mean, P50 and
P99, E2E mean, on the stable stages; and on every stage whether servesim calls it overloaded
where the real server was (`overloaded_measured`). The measured TTFT and E2E are client-side
(HTTP, tokenisation, detokenisation and streaming included); servesim's are engine-side until
it models the front end, so its TTFT errors include that gap.

The measurements are not the project's (no licence upstream): they are read from `../shared/`
at run time and only the errors are printed or written, never the figures.

Known differences from the real runs: a stage starts cold (the real stage 1 followed stage 0 on
a warm server: its first 100 requests hit the cache there); no client timeout (the reasoning
stages' clients gave up after 300 s); no KV offloading to CPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
REALRUNS = ROOT.parent / "shared" / "realruns" / "h100_vllm0151"
METRICS = [  # (name, measured column in ms, servesim summary key, statistic)
    ("TPOT mean", "tpot_mean_ms", "tpot_s", "mean"),
    ("TPOT P50", "tpot_p50_ms", "tpot_s", "p50"),
    ("TTFT mean", "ttft_mean_ms", "ttft_s", "mean"),
    ("TTFT P50", "ttft_p50_ms", "ttft_s", "p50"),
    ("TTFT P99", "ttft_p99_ms", "ttft_s", "p99"),
    ("E2E mean", "e2e_mean_ms", "e2e_s", "mean"),
]


def stage_name(row: dict[str, str]) -> str:
    return f"{row['experiment']}@{float(row['stage_rate_req_per_s']):g}"


def scenario(row: dict[str, str], realruns: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The scenario of one stage, as recorded (see the module's docstring)."""
    system = int(row["system_prompt_len_tokens"])
    question = int(row["question_len_tokens"])
    prompt = round(float(row["prompt_len_client_mean_tokens"]))
    # The client's count runs ~5% above system prompt + question: spread it over both.
    system_tokens = round(system * prompt / (system + question))
    replica: dict[str, Any] = {
        "model": str(realruns / row["model_config"].removeprefix("h100_vllm0151/")),
        "gpu": "h100-sxm",
        "parallelism": {"tensor": int(row["tensor_parallel_size"])},
        "scheduler": {"name": "vllm_v1", "engine_version": row["engine_version"],
                      "max_num_batched_tokens": int(row["max_num_batched_tokens"]),
                      "max_num_seqs": int(row["max_num_seqs"]),
                      "enable_chunked_prefill": row["chunked_prefill"] == "true"},
        "kv_cache": {"block_size": int(row["kv_block_size_tokens"]),
                     "gpu_memory_utilization": float(row["gpu_memory_utilization"])},
        "prefix_caching": row["prefix_caching"] == "true",
    }
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        node = replica
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return {
        "seed": 0,
        "workload": {"format": "shared_prefix", "num_groups": int(row["num_groups"]),
                     "num_prompts_per_group": int(row["num_prompts_per_group"]),
                     "system_prompt_tokens": system_tokens,
                     "question_tokens": prompt - system_tokens,
                     "output_tokens": int(row["max_tokens"]),
                     "rate_qps": float(row["stage_rate_req_per_s"]),
                     "duration_s": float(row["stage_duration_s"]),
                     "hash_block_tokens": int(row["kv_block_size_tokens"])},
        "replica": replica,
    }


def simulate(args: tuple[dict[str, str], Path, dict[str, Any]]) -> dict[str, Any]:
    """One stage's servesim summary: the compared statistics in ms and the overload verdict."""
    from sim import run_scenario
    from sim.config.scenario import parse_scenario

    row, realruns, overrides = args
    res = run_scenario(parse_scenario(scenario(row, realruns, overrides), stage_name(row)))
    summary = res.summary
    out: dict[str, Any] = {"overloaded": summary["overload"]["verdict"] != "stable",
                           "latency_model": summary["latency_model"]}
    for name, _, key, stat in METRICS:
        value = summary[key][stat]
        out[name] = None if value is None else value * 1e3
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item}: give FIELD=VALUE")
        out[field] = yaml.safe_load(value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--realruns", type=Path, default=REALRUNS)
    parser.add_argument("--stage", action="append", help="only these stages (name@rate)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a replica field for every stage, e.g. latency.overhead_s=0")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    path = args.realruns / "runs.csv"
    if not path.is_file():
        print(f"{path}: not found (give --realruns)", file=sys.stderr)
        return 2
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["row_type"] == "stage"]
    if args.stage:
        rows = [r for r in rows if stage_name(r) in args.stage]
    overrides = parse_set(args.set)
    from sim.config.errors import InputError

    try:
        with ProcessPoolExecutor(args.jobs) as pool:
            sims = list(pool.map(simulate, [(r, args.realruns, overrides) for r in rows]))
    except InputError as e:
        print(e, file=sys.stderr)
        return 2

    lines = ["servesim vs vLLM 0.15.1 on H100-SXM: (servesim - measured) / measured, %"
             + (f"; --set {' '.join(args.set)}" if args.set else ""),
             "",
             "| stage | " + " | ".join(name for name, *_ in METRICS) + " | overloaded (sim/real) |",
             "|---|" + "---:|" * len(METRICS) + "---|"]
    errors: dict[str, list[float]] = {name: [] for name, *_ in METRICS}
    verdicts_equal = 0
    for row, sim in zip(rows, sims, strict=True):
        real_over = row["overloaded_measured"] == "true"
        verdicts_equal += sim["overloaded"] == real_over
        cells = []
        for name, column, *_ in METRICS:
            measured, got = float(row[column]), sim[name]
            if real_over or got is None or not measured:
                cells.append("")
                continue
            error = 100 * (got - measured) / measured
            errors[name].append(error)
            cells.append(f"{error:+.1f}")
        verdict = f"{'yes' if sim['overloaded'] else 'no'}/{'yes' if real_over else 'no'}"
        lines.append(f"| {stage_name(row)} | " + " | ".join(cells) + f" | {verdict} |")
    lines.append("| median abs, stable | " + " | ".join(
        f"{_median([abs(e) for e in errs]):.1f}" if errs else "" for errs in errors.values())
        + f" | {verdicts_equal}/{len(rows)} equal |")
    lines.append("| worst abs, stable | " + " | ".join(
        f"{max(abs(e) for e in errs):.1f}" if errs else "" for errs in errors.values()) + " | |")
    model = sims[0]["latency_model"] if sims else {}
    lines += ["", f"latency model: {yaml.safe_dump(model, default_flow_style=True).strip()}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = "python validation/public/h100_vllm0151.py " + " ".join(sys.argv[1:])
        args.out.write_text(f"{text}\n\n`{command}` at {_commit()}, "
                            f"{datetime.date.today().isoformat()}\n")
    return 0


def _commit() -> str:
    """This checkout's commit, and whether files differ from it."""
    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return head + (" with changes" if git("status", "--porcelain", "--", "sim") else "")


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return math.nan if not n else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


if __name__ == "__main__":
    raise SystemExit(main())
