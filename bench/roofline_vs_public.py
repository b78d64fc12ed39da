"""servesim's roofline against public measurements of Llama-3 8B and 70B on H100s.

Reads `bench/public_llama_h100.csv` (each row a published figure with its source and quote),
keeps the bf16/fp16 rows of a batch shape we can reproduce, and for each simulates that batch
as the benchmark ran it: `batch_size` requests of `input_tokens` arriving at once, each
generating `output_tokens`, on one replica at the row's tensor-parallel degree, scheduled
prefill-first as vLLM 0.5's default (whole prompts, up to the model's context length of tokens
per iteration). The figure compared is the row's metric: the batch's end-to-end latency, the
time to its first tokens, or decode tokens per second of a batch of one.

    python bench/roofline_vs_public.py [--markdown]

Prints predicted/measured per row for three rooflines: fitted GEMMs alone (`elementwise:
none`), the default (fitted GEMMs plus the fitted elementwise kernels, `elementwise:
calibrated`: norms, rotary, activation, residual add, embedding) and the naive one (datasheet
max of compute and memory, no elementwise kernels), with the all-reduce either from Vidur's
measured H100 NCCL table (where ../shared/profiles is present) or from the NVLink bandwidth;
then, per variant, the rows within 10% and 20% and the mean |log(predicted / measured)|. Then
the same for the CSV's fp8 rows, simulated with `quantization: fp8` (`tpot_ms`: time per
output token after the first, of a batch of one).
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim.config.scenario import parse_scenario  # noqa: E402
from sim.runner import run_scenario  # noqa: E402

TABLE = REPO.parent / "shared" / "profiles" / "vidur" / "network" / "h100_dgx" / "all_reduce.csv"
MODELS = {"Meta-Llama-3-8B": "llama-3-8b", "Meta-Llama-3.1-8B": "llama-3.1-8b",
          "Meta-Llama-3-70B": "llama-3.1-70b",  # 3.1-70B: Llama-3-70B's shape, longer context
          "Llama-3.1-70B": "llama-3.1-70b", "Llama-3.3-70B-Instruct": "llama-3.1-70b"}
METRICS = ("e2e_latency_s", "ttft_ms", "tpot_ms", "output_tokens_per_s")
# Column -> the roofline's settings.
VARIANTS: dict[str, dict[str, Any]] = {
    "no kernels": {"elementwise": "none"},
    "default": {},
    "naive": {"linear": "naive", "elementwise": "none"},
}


def usable(row: dict[str, str], dtypes: tuple[str, ...] = ("fp16", "bf16")) -> bool:
    return (row["dtype"] in dtypes and row["model"] in MODELS
            and row["batch_size"] != "" and row["metric"] in METRICS)


def predict(row: dict[str, str], settings: dict[str, Any], workdir: Path) -> float:
    """The row's figure as servesim predicts it; an fp8 row runs `quantization: fp8` (weights
    in fp8, KV in bf16: the sources do not say how their KV was stored)."""
    batch = int(row["batch_size"])
    prompt = int(row["input_tokens"]) if row["input_tokens"] else 1
    output = int(row["output_tokens"])
    trace = workdir / f"b{batch}_p{prompt}_o{output}.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     + "".join(f"0.0,{prompt},{output}\n" for _ in range(batch)))
    latency: dict[str, object] = {"kind": "roofline", **settings}
    tensor = int(row["tensor_parallel"])
    if tensor > 1 and TABLE.is_file():
        latency["all_reduce_table"] = str(TABLE)
    scenario = parse_scenario({
        "name": "public", "workload": {"format": "vidur", "path": str(trace)},
        "replica": {"model": MODELS[row["model"]], "gpu": "h100-sxm",
                    "parallelism": {"tensor": tensor},
                    "quantization": "fp8" if row["dtype"] == "fp8" else "none",
                    "scheduler": {"name": "prefill_first", "max_num_batched_tokens": 8192},
                    "latency": latency}}, "<bench>")
    results = run_scenario(scenario)
    req = results.requests
    if row["metric"] == "e2e_latency_s":
        return float(req["finish_s"].max())
    if row["metric"] == "ttft_ms":
        return 1e3 * float((req["arrival_s"] + req["ttft_s"]).max())
    if row["metric"] == "tpot_ms":  # a batch of one: time per output token after the first
        return 1e3 * float((req["finish_s"].max() - req["ttft_s"].max()) / (output - 1))
    # Decode tokens per second of one request: output tokens after the first, over their time.
    return float((output - 1) / (req["finish_s"].max() - req["ttft_s"].max()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="a README table")
    parser.add_argument("--csv", type=Path, default=REPO / "bench" / "public_llama_h100.csv")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        all_rows = list(csv.DictReader(f))
    for title, dtypes in (("fp16/bf16 rows", ("fp16", "bf16")),
                          ("fp8 rows (quantization: fp8)", ("fp8",))):
        rows = [r for r in all_rows if usable(r, dtypes)]
        print(f"{title}: {len(rows)}")
        report(rows, args.markdown)
        print()


def report(rows: list[dict[str, str]], markdown: bool) -> None:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            measured = float(row["value"])
            got = {name: predict(row, settings, Path(tmp))
                   for name, settings in VARIANTS.items()}
            out.append((row, measured, got))
    sep = " | " if markdown else "  "
    head = ["model", "TP", "engine", "batch", "in/out tokens", "metric", "measured"]
    for name in VARIANTS:
        head += [name, "ratio"]
    print(("| " if markdown else "") + sep.join(head) + (" |" if markdown else ""))
    if markdown:
        print("|---|---:|---|---:|---|---|---:|" + "---:|---:|" * len(VARIANTS))
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for row, measured, got in out:
        engine = row["engine"].removeprefix("NVIDIA ").split(" ")[0]
        cells = [row["model"], row["tensor_parallel"], engine,
                 row["batch_size"], f"{row['input_tokens'] or '-'}/{row['output_tokens']}",
                 row["metric"], f"{measured:.4g}"]
        for name, value in got.items():
            ratios[name].append(value / measured)
            cells += [f"{value:.4g}", f"{value / measured:.2f}"]
        print(("| " if markdown else "") + sep.join(cells) + (" |" if markdown else ""))
    print()
    for name, values in ratios.items():
        r = np.array(values)
        print(f"{name}: {len(r)} rows, within 10% {np.mean(np.abs(r - 1) <= 0.1):.0%}, within "
              f"20% {np.mean(np.abs(r - 1) <= 0.2):.0%}, mean |log ratio| "
              f"{np.mean(np.abs(np.log(r))):.3f}, {r.min():.2f} to {r.max():.2f}")

if __name__ == "__main__":
    main()
