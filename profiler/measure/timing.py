"""Time whole iterations of mixes on a device, resumably, and save them with their metadata."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from profiler.fit.fitting import check_profile
from profiler.measure.mixes import GridSpec, Mix
from profiler.measure.model import Decoder, SeqInput
from sim.config.errors import COMMAND_LINE, InputError
from sim.config.input_file import FileProblem, check_regular, loads
from sim.hardware.models import ModelShape
from sim.hardware.parallelism import Parallelism
from sim.results.interrupts import on_sigint

METADATA_KEY = b"servesim"
FEATURES = ("num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens", "num_sampled_tokens",
            "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")


def default_grid(shape: ModelShape, device: str, tensor_parallel: int = 1) -> GridSpec:
    """CPU: a small grid a test can afford. CUDA: the serving range (8k tokens, 32k contexts,
    256 decodes), with as many KV slots as fit beside the weights (of one tensor-parallel
    shard: its share of the weights and of each token's KV)."""
    if device == "cpu":
        return GridSpec(max_tokens=512, max_context=4096, max_batch=64, max_kv_tokens=65536)
    split = Parallelism(tensor=tensor_parallel)
    free = torch.cuda.mem_get_info()[0] - shape.weight_bytes / tensor_parallel
    slots = int(0.7 * free / split.kv_bytes_per_token_per_gpu(shape))
    return GridSpec(max_tokens=8192, max_context=32768, max_batch=256,
                    max_kv_tokens=min(slots, 1_500_000))


class Timer:
    """Times one iteration: CUDA events after synchronising, or the wall clock on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def inputs_for(mix: Mix, vocab_size: int, num_slots: int, rng: np.random.Generator,
               block_size: int = 16) -> list[SeqInput]:
    """Each request gets its own stretch of KV slots, laid out one after another from block
    boundaries (as a paged cache would hold them)."""
    seqs = []
    offset = 0
    parts = [(c.num_cached_tokens, c.num_new_tokens, c.samples) for c in mix.chunks]
    parts += [(c, 1, True) for c in mix.decode_contexts]
    for cached, new, samples in parts:
        if offset + cached + new > num_slots:
            offset = 0  # more KV than the pool: reuse slots (reads stay the stated length)
        ids = torch.from_numpy(rng.integers(0, vocab_size, new))
        seqs.append(SeqInput(offset, cached, ids, samples))
        offset += -(-(cached + new) // block_size) * block_size
    return seqs


def measure_mix(decoder: Decoder, mix: Mix, timer: Timer, warmup: int, reps: int,
                rng: np.random.Generator) -> np.ndarray:
    seqs = inputs_for(mix, decoder.shape.vocab_size, decoder.k_pool[0].shape[0], rng,
                      decoder.block_size)
    for _ in range(warmup):
        decoder.forward(seqs)
    return np.array([timer(lambda: decoder.forward(seqs)) for _ in range(reps)])


def row(mix: Mix, split: str, samples_s: np.ndarray) -> dict[str, Any]:
    shape = mix.shape()
    out: dict[str, Any] = {"key": mix.key, "tag": mix.tag, "split": split}
    out.update({name: int(getattr(shape, name)) for name in FEATURES})
    out.update({
        "num_tokens": mix.num_tokens,
        "median_s": float(np.median(samples_s)),
        "mean_s": float(samples_s.mean()),
        "std_s": float(samples_s.std()),
        "min_s": float(samples_s.min()),
        "p10_s": float(np.percentile(samples_s, 10)),
        "p90_s": float(np.percentile(samples_s, 90)),
        "max_s": float(samples_s.max()),
        "samples_s": samples_s.tolist(),
    })
    return out


def environment(device: str, dtype: torch.dtype, backend: str) -> dict[str, Any]:
    """Facts recorded with every profile."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "attention_backend": backend,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_cpu": _cpu_name(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        info["device_name"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["driver"] = _driver_version()
    else:
        info["device_name"] = f"cpu: {_cpu_name()}"
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def save(path: Path, rows: list[dict[str, Any]], metadata: dict[str, Any]) -> None:
    """Write atomically, so an interrupted run keeps every measurement already saved."""
    table = pa.Table.from_pandas(pd.DataFrame(rows), preserve_index=False)
    schema_meta = dict(table.schema.metadata or {})
    schema_meta[METADATA_KEY] = json.dumps(metadata, sort_keys=True).encode()
    table = table.replace_schema_metadata(schema_meta)
    tmp = path.with_suffix(path.suffix + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def load(path: Path, field: str = "PROFILE") -> tuple[pd.DataFrame, dict[str, Any]]:
    """A profile's rows and the metadata `profile` saved with them (an empty mapping if it has
    none). A path that is not a regular file, a file that is not parquet and metadata that is
    not a JSON object are one-line `InputError`s naming `path` and `field` (the option that
    gave it); the rows are checked by `profiler.fit.fitting.check_profile`."""
    check_regular(path, path, field)  # a named pipe would hang the reader
    try:
        table = pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise InputError(path, field, str(path),
                         f"not a profile (not parquet: {type(exc).__name__})") from None
    raw = (table.schema.metadata or {}).get(METADATA_KEY, b"{}")
    try:
        meta = loads(raw)
    except FileProblem as exc:
        raise InputError(path, "metadata", METADATA_KEY.decode(), str(exc)) from None
    if not isinstance(meta, dict):
        raise InputError(path, "metadata", type(meta).__name__,
                         "must be a JSON object (not a servesim profile)")
    return table.to_pandas(), meta


def default_attention(device: str) -> str:
    """varlen (paged FlashAttention) on CUDA where this torch has it; sdpa elsewhere."""
    if not device.startswith("cuda"):
        return "sdpa"
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return "sdpa"
    return "varlen" if "block_table" in inspect.signature(varlen_attn).parameters else "sdpa"


# What a profile's rows were measured under and its metadata records once for all of them:
# metadata key (grid fields as grid.<name>) -> the option that sets it.
RESUME_CONDITIONS = {
    "grid.max_tokens": "--max-tokens", "grid.max_context": "--max-context",
    "grid.max_batch": "--max-batch", "grid.max_kv_tokens": "--max-context / --max-batch",
    "grid.token_knots": "--max-tokens", "warmup": "--warmup", "reps": "--reps",
    "seed": "--seed", "attention_backend": "--attention", "dtype": "--device",
    "torch_threads": "--threads", "torch": "torch (install the version that measured it)",
    "device_name": "--device (on the machine that measured it)",
}


def _condition(meta: dict[str, Any], key: str) -> Any:
    head, _, name = key.partition(".")
    value = meta.get(head) if not name else (meta.get(head) or {}).get(name)
    return list(value) if isinstance(value, tuple) else value


def check_same_conditions(out: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Resuming adds rows under the profile's one record of how they were measured: refuse when
    this command would measure under other conditions (a grid, repetitions, seed or backend
    of its own), naming the first that differs, rather than mix two profiles under one record
    (a conditions key the earlier profile lacks is not compared)."""
    for key, option in RESUME_CONDITIONS.items():
        before, now = _condition(old, key), _condition(new, key)
        if before is not None and before != now:
            raise InputError(out, key, before, (
                f"this profile was measured with {key} {before!r}, this command would measure "
                f"with {now!r}: give the same {option} to resume it, or another --out"))


def profile(shape: ModelShape, device: str, out: Path, spec: GridSpec, mixes: list[tuple[Mix, str]],
            *, dtype: torch.dtype, warmup: int, reps: int, seed: int, command: str,
            attention: str = "sdpa", tensor_parallel: int = 1,
            on_progress: Callable[[int, int], None] | None = None,
            save_every_s: float = 20.0) -> pd.DataFrame:
    """Measure every mix not already in `out` (resume), saving as it goes. With
    `tensor_parallel` T > 1, one GPU's shard of a T-way tensor-parallel replica."""
    metadata = {"model": shape.name, "model_shape": asdict(shape), "grid": asdict(spec),
                "warmup": warmup, "reps": reps, "seed": seed, "command": command,
                "tensor_parallel": tensor_parallel, **environment(device, dtype, attention)}
    rows: list[dict[str, Any]] = []
    if out.exists():
        previous, old_meta = load(out, "--out")
        check_profile(previous, old_meta, out, for_fit=False)
        if old_meta.get("model") != shape.name:
            raise InputError(out, "model", old_meta.get("model"),
                             f"this profile is of another model; cannot resume it for {shape.name}")
        if old_meta.get("tensor_parallel", 1) != tensor_parallel:
            raise InputError(out, "tensor_parallel", old_meta.get("tensor_parallel", 1),
                             f"this profile is of another shard; cannot resume it with "
                             f"--tensor-parallel {tensor_parallel}")
        check_same_conditions(out, old_meta, metadata)
        # The record keeps when and how its first rows were measured; each resumption is
        # added (its date and command replaced them: a profile measured days ago and resumed
        # for two mixes read as measured today).
        resumed = [*old_meta.get("resumed", []),
                   {"date": metadata["date"], "command": command, "num_rows_before": len(previous)}]
        metadata.update({k: old_meta[k] for k in ("date", "command") if k in old_meta},
                        resumed=resumed)
        rows = [{str(k): v for k, v in r.items()} for r in previous.to_dict("records")]
        for r in rows:
            r["samples_s"] = list(r["samples_s"])
    done = {r["key"] for r in rows}
    todo = [(m, split) for m, split in mixes if m.key not in done]
    if rows and not todo:  # complete: the file stays as it was, byte for byte
        return pd.DataFrame(rows)
    rng = np.random.default_rng(seed)
    # Measure in random order: drift of the machine over the run (clocks, heat, neighbours)
    # then spreads over all kinds of mix instead of biasing the last ones measured.
    todo = [todo[i] for i in rng.permutation(len(todo))]
    from profiler.measure.device import check_memory

    check_memory(shape, spec.max_kv_tokens, device, dtype, tensor_parallel, COMMAND_LINE,
                 "--model", shape.name)
    decoder = Decoder(shape, spec.max_kv_tokens, device=device, dtype=dtype, seed=seed,
                      attention=attention, tensor_parallel=tensor_parallel)
    timer = Timer(device)
    last_save = time.monotonic()
    stop = []  # Ctrl-C: stop after the mix in progress, save, then say so
    with on_sigint(lambda: stop.append(True)):
        for i, (mix, split) in enumerate(todo, start=1):
            rows.append(row(mix, split, measure_mix(decoder, mix, timer, warmup, reps, rng)))
            if on_progress is not None:
                on_progress(len(rows), len(rows) + len(todo) - i)
            if stop:
                break
            if time.monotonic() - last_save > save_every_s:
                save(out, rows, metadata)
                last_save = time.monotonic()
        if rows:
            save(out, rows, metadata)
    if stop:
        raise ProfileInterrupted(len(rows), len(todo))
    return pd.DataFrame(rows)


class ProfileInterrupted(KeyboardInterrupt):
    """Ctrl-C while profiling: the mixes measured so far (`num_rows` in all) are saved."""

    def __init__(self, num_rows: int, num_todo: int) -> None:
        super().__init__(num_rows, num_todo)
        self.num_rows, self.num_todo = num_rows, num_todo
