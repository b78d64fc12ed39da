"""Bad input around a deployment's hardware: communication tables that are not CSV text or
lack values, KV blocks given beside weights that do not fit, blocks beyond memory (allowed,
and said), and a table's errors named at the pool's full field."""

from __future__ import annotations

import os
from pathlib import Path

from sim.config.scenario import load_scenario
from sim.runner import run_scenario
from tests.helpers import assert_one_line_error, run_cli, run_cli_out

SYNTH = """\
name: deploy
workload:
  format: synthetic
  num_requests: 30
  arrivals: {qps: 2}
  lengths:
    prompt: {dist: uniform, low: 50, high: 400}
    output: {dist: uniform, low: 5, high: 40}
"""
HEADER = ("time_stats.all_reduce.median,num_workers,size,devices_per_node\n")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def simulate(monkeypatch, capsys, tmp_path: Path, text: str) -> tuple[int, str]:
    return run_cli(monkeypatch, capsys, "simulate", str(write(tmp_path, text)), "--out",
                   str(tmp_path / "out"))


def with_table(table: Path) -> str:
    return SYNTH + ("replica: {model: llama-3.1-8b, gpu: h100-sxm, parallelism: {tensor: 2}, "
                    "latency: {kind: roofline, all_reduce_kernel: nccl, "
                    f"all_reduce_table: {table}}}}}\n")


def test_a_table_row_missing_values_is_refused_with_its_line(tmp_path, monkeypatch, capsys):
    table = tmp_path / "ar.csv"
    table.write_text(HEADER + "0.02,2,2048,8\n0.03,2,1048576,8\n0.05,2\n")
    code, err = simulate(monkeypatch, capsys, tmp_path, with_table(table))
    assert_one_line_error(code, err, "ar.csv", "replica.latency.all_reduce_table",
                          "line 4: a value is missing")


def test_a_table_that_is_not_utf8_csv_is_refused(tmp_path, monkeypatch, capsys):
    table = tmp_path / "ar.csv"
    table.write_bytes(HEADER.encode() + b"0.02,2,2048,8\n\xff\xfe,2,4096,8\n")
    code, err = simulate(monkeypatch, capsys, tmp_path, with_table(table))
    assert_one_line_error(code, err, "ar.csv", "all_reduce_table", "not UTF-8 text")
    table.write_text(HEADER + "0.02,2,2048," + "8" * 200_000 + "\n")  # beyond csv's limit
    code, err = simulate(monkeypatch, capsys, tmp_path, with_table(table))
    assert_one_line_error(code, err, "ar.csv", "all_reduce_table", "not a CSV")


def test_a_table_that_is_not_a_regular_file_is_refused_unread(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "ar.csv"
    os.mkfifo(fifo)  # opening it would block until a writer came
    code, err = simulate(monkeypatch, capsys, tmp_path, with_table(fifo))
    assert_one_line_error(code, err, "ar.csv", "all_reduce_table", "not a regular file")


def test_a_decode_pools_table_is_named_at_its_full_field(tmp_path, monkeypatch, capsys):
    table = tmp_path / "ar.csv"
    table.write_text(HEADER + "0.02,4,2048,8\n0.03,4,1048576,8\n")  # no rows for 2 GPUs
    replica = ("{model: llama-3.1-8b, gpu: h100-sxm, parallelism: {tensor: 2}, "
               f"latency: {{kind: roofline, all_reduce_table: {table}}}}}")
    code, err = simulate(monkeypatch, capsys, tmp_path, SYNTH + (
        "replica: {model: llama-3.1-8b, gpu: h100-sxm}\n"
        "cluster:\n  prefill: {replicas: 1}\n"
        f"  decode: {{replicas: 1, replica: {replica}}}\n"))
    assert_one_line_error(code, err, "ar.csv", "cluster.decode.replica.latency.all_reduce_table",
                          "no rows for 2 GPUs")


def test_blocks_given_do_not_make_weights_fit(tmp_path, monkeypatch, capsys):
    # 131 GiB of Llama-3.1-70B weights on one 80 GiB H100: no block count makes that a
    # deployment.
    code, err = simulate(monkeypatch, capsys, tmp_path, SYNTH + (
        "replica: {model: llama-3.1-70b, gpu: h100-sxm, kv_cache: {num_blocks: 1000}}\n"))
    assert_one_line_error(code, err, "replica.kv_cache.num_blocks=1000",
                          "131.4 GiB of weights per GPU", "80.0 GiB")


def test_blocks_beyond_memory_run_as_an_idealised_cache_and_say_so(tmp_path, monkeypatch,
                                                                   capsys):
    # 1M blocks of 16 tokens at 128 KiB a token: 1,953 GiB of KV beside 15 GiB of weights.
    text = SYNTH + "replica: {model: llama-3.1-8b, gpu: h100-sxm, kv_cache: {num_blocks: " \
                   "1000000}}\n"
    res = run_scenario(load_scenario(write(tmp_path, text)))
    note = res.summary["run"]["blocks_beyond_memory"]["colocated"]
    assert note.startswith("1,000,000 KV blocks given") and "of 80.0 GiB on a h100-sxm" in note
    code, out = run_cli_out(monkeypatch, capsys, "simulate", str(tmp_path / "s.yaml"),
                            "--out", str(tmp_path / "out"))
    assert code == 0 and "idealised KV cache (colocated): 1,000,000 KV blocks given" in " ".join(
        out.split())  # as printed, however the terminal wraps it
    # Within memory, the summary has no such entry.
    within = run_scenario(load_scenario(write(tmp_path, text.replace("1000000", "1000"))))
    assert "blocks_beyond_memory" not in within.summary["run"]


def test_a_custom_gpus_figure_given_in_the_wrong_unit_is_refused(tmp_path, monkeypatch, capsys):
    # 3.35 TB/s written as 3.35: refused, where it ran with a TTFT of 5e10 s.
    gpu = ("{name: my-gpu, peak_bf16_flops: 4.0e+14, memory_bandwidth_bytes_s: 3.35, "
           "memory_bytes: 8.0e+10, interconnect_bandwidth_bytes_s: 6.4e+10}")
    code, err = simulate(monkeypatch, capsys, tmp_path,
                         SYNTH + f"replica: {{model: llama-3.1-8b, gpu: {gpu}}}\n")
    assert_one_line_error(code, err, "memory_bandwidth_bytes_s", "3.35")


def test_a_run_passing_2_to_the_32_seconds_is_refused(tmp_path, monkeypatch, capsys):
    # All-reduces measured at 1e300 ms (finite, positive, absurd): the first iteration would
    # end past 2**32 s, where float64 times lose their microseconds.
    table = tmp_path / "ar.csv"
    table.write_text(HEADER + "1e300,2,2048,8\n1e300,2,1048576,8\n")
    code, err = simulate(monkeypatch, capsys, tmp_path, with_table(table))
    assert_one_line_error(code, err, "replica.latency", "passes 2**32 s")
