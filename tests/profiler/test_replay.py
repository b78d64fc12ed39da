"""`servesim replay` on the CPU with the tiny model (real torch, no mocks): the simulator with
the `recorded` latency must make the very same plans and timestamps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch", reason="replay needs torch (pip install -e .[profile])")

from profiler.measure.model import Decoder, SeqInput  # noqa: E402
from profiler.replay.agreement import PLAN_COLUMNS  # noqa: E402
from profiler.replay.blocks import BlockMap  # noqa: E402
from profiler.replay.executor import Executor  # noqa: E402
from profiler.replay.serve import replay  # noqa: E402
from sim.config.scenario import load_scenario, parse_scenario  # noqa: E402
from sim.core.kv_cache import KVCacheManager  # noqa: E402
from sim.core.plan import Plan  # noqa: E402
from sim.hardware.models import MODELS  # noqa: E402
from sim.results.metrics.arrived import arrived_mask  # noqa: E402
from sim.results.run_dir import Results  # noqa: E402
from sim.runner import run_scenario  # noqa: E402
from tests.helpers import (  # noqa: E402
    assert_one_line_error,
    make_request,
    read_until,
    run_cli,
    run_cli_out,
    sigint_default,
    within,
)

CHUNKED = "{name: chunked_prefill, token_budget: 64, max_num_seqs: 16}"
PREFILL_FIRST = "{name: prefill_first, max_num_batched_tokens: 256, max_num_seqs: 16}"


def trace_scenario(tmp_path: Path, rows: list[tuple[float, int, int]], scheduler: str = CHUNKED,
                   num_blocks: int = 64, extra: str = "") -> Path:
    """A Vidur-format trace of exactly these (arrival, prompt, output) rows, on the tiny model."""
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     + "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    path = tmp_path / "scenario.yaml"
    path.write_text(f"name: replay_test\nworkload: {{format: vidur, path: {trace}}}\n"
                    f"replica: {{model: tiny, scheduler: {scheduler}, "
                    f"kv_cache: {{block_size: 16, num_blocks: {num_blocks}}}}}\n{extra}")
    return path


ROWS = [(0.0, 40, 6), (0.002, 90, 4), (0.004, 7, 9), (0.03, 130, 3), (0.031, 20, 5),
        (0.2, 33, 4)]  # bursts (queueing, batching), then an idle gap


def recorded_twin(path: Path, replay_dir: Path) -> Results:
    """The scenario simulated with the durations its replay measured."""
    data = load_scenario(path).model_dump(mode="json")
    data["replica"]["latency"] = {"kind": "recorded", "path": str(replay_dir)}
    return run_scenario(parse_scenario(data, path))


def assert_same_run(a: Results, b: Results) -> None:
    ra, rb = a.requests, b.requests
    assert ra["status"].tolist() == rb["status"].tolist()
    assert ra["num_generated_tokens"].tolist() == rb["num_generated_tokens"].tolist()
    assert ra["num_preemptions"].tolist() == rb["num_preemptions"].tolist()
    for col in PLAN_COLUMNS:
        assert a.iterations[col].tolist() == b.iterations[col].tolist(), col
    for col in ("first_scheduled_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose(ra[col], rb[col], rtol=1e-9, atol=1e-12, err_msg=col)


@pytest.mark.parametrize("scheduler", [CHUNKED, PREFILL_FIRST], ids=["chunked", "prefill_first"])
def test_replay_is_reproduced_by_the_simulator_with_its_recorded_durations(tmp_path, scheduler):
    path = trace_scenario(tmp_path, ROWS, scheduler)
    out = tmp_path / "replay"
    served = replay(load_scenario(path), out_dir=out)
    assert (served.requests["status"] == "finished").all()
    assert (served.requests["num_generated_tokens"] == served.requests["num_output_tokens"]).all()
    its = served.iterations
    assert (its["forward_s"] > 0).all() and (its["host_s"] > 0).all()
    np.testing.assert_allclose(its["forward_s"] + its["host_s"], its["duration_s"])
    # Iterations tile the busy time: each starts when the previous ended, or at an arrival.
    ends = (its["start_s"] + its["duration_s"]).to_numpy()
    gaps = its["start_s"].to_numpy()[1:] - ends[:-1]
    assert (gaps >= -1e-12).all() and np.isin(its["start_s"][1:][gaps > 1e-9],
                                                served.requests["arrival_s"]).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["complete"] and summary["run"]["latency"] == "replay"
    assert summary["replay"]["host_s"]["count"] == len(its)

    twin = recorded_twin(path, out)
    assert_same_run(served, twin)
    described = twin.summary["latency_model"]
    assert described["num_mismatched_iterations"] == 0
    assert described["num_asked_iterations"] == described["num_recorded_iterations"] == len(its)


def test_preemption_happens_in_replay_as_in_simulation(tmp_path):
    """A KV budget too tight for every decode: the newest request is preempted, recomputed,
    and the simulator does the same at the same iterations."""
    rows = [(0.0, 60, 40), (0.0, 60, 40), (0.0, 60, 40)]
    scheduler = "{name: chunked_prefill, token_budget: 256, max_num_seqs: 8, " \
                "decode_reserve_tokens: 0}"
    path = trace_scenario(tmp_path, rows, scheduler, num_blocks=14)
    served = replay(load_scenario(path), out_dir=tmp_path / "replay")
    assert served.requests["num_preemptions"].sum() > 0
    assert (served.requests["status"] == "finished").all()
    assert served.summary["replicas"][0]["kv_blocks_in_use_at_end"] == 0
    assert_same_run(served, recorded_twin(path, tmp_path / "replay"))


def test_a_prompt_that_cannot_fit_is_rejected_the_same_way(tmp_path):
    rows = [(0.0, 30, 3), (0.001, 2000, 2), (0.002, 25, 4)]
    path = trace_scenario(tmp_path, rows, num_blocks=32)  # 512 KV slots
    served = replay(load_scenario(path), out_dir=tmp_path / "replay")
    simulated = run_scenario(load_scenario(path))  # its own (roofline) latency
    assert served.requests["status"].tolist() == ["finished", "rejected", "finished"]
    assert served.requests["reason"].tolist() == simulated.requests["reason"].tolist()
    assert served.requests["reason"][1].startswith("kv_capacity: needs 2001 KV slots")
    assert_same_run(served, recorded_twin(path, tmp_path / "replay"))


def test_recomputation_after_preemption_gives_the_decodes_logits():
    """The executor recomputes the very same token ids at the same positions: the recompute's
    last row gives what the decode it replaces gave."""
    kv = KVCacheManager(64, 16)
    ex = Executor(MODELS.get("tiny"), kv, seed=3)
    req = make_request(0, prompt=20, output=5)
    requests = {0: req}
    logits = []

    def step(num_tokens: int) -> None:
        plan = Plan({0: num_tokens})
        assert kv.try_allocate(req, num_tokens)
        seqs = ex.prepare(plan, requests)
        out = ex.decoder.forward(seqs)
        ex.sample(plan, requests, out)
        logits.append(out)
        req.num_computed_tokens += num_tokens
        req.num_output_tokens += 1

    step(20)  # prefill: first token
    step(1)
    step(1)  # two decodes: the third token's logits in logits[2]
    kv.free(req)  # preempted: blocks gone
    ex.release_id(0)
    req.num_computed_tokens, req.num_output_tokens = 0, 2
    step(22)  # recompute prompt + 2 outputs: samples the third token again
    assert torch.allclose(logits[2], logits[3], atol=1e-4)


def test_scattered_blocks_read_like_a_contiguous_stretch():
    shape = MODELS.get("tiny")
    model = Decoder(shape, 64 * 16, seed=1)
    ids = torch.randint(0, shape.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    whole = model.forward([SeqInput(0, 0, ids, True)])
    blocks = torch.tensor([9, 3, 30])  # 40 tokens over three scattered blocks
    model.forward([SeqInput(0, 0, ids[:25], False, blocks)])
    paged = model.forward([SeqInput(0, 25, ids[25:], True, blocks)])
    assert torch.allclose(whole, paged, atol=1e-5)


def test_block_map_keeps_requests_contiguous_and_in_step():
    blocks = BlockMap(10, 16)
    blocks.grow(0, 1, 4)  # claims room for 4 blocks
    blocks.grow(1, 1, 3)  # goes beyond that room
    blocks.grow(0, 4, 4)
    assert blocks.blocks[0] == [0, 1, 2, 3] and blocks.contiguous(0)
    assert blocks.blocks[1] == [4]
    blocks.release(0)
    assert blocks.num_used_blocks == 1
    blocks.grow(2, 6, 9)  # the largest run left is 5 blocks: then it must jump
    assert blocks.num_held(2) == 6 and not blocks.contiguous(2)
    assert blocks.num_used_blocks == 7


def test_bad_inputs_are_one_line_errors(tmp_path, monkeypatch, capsys):
    path = trace_scenario(tmp_path, ROWS, extra="cluster: {replicas: 2}\n")
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "cluster.replicas=2", "one colocated replica")
    # A timeout replay would not apply: refused, not a run that silently ignores it.
    path = trace_scenario(tmp_path, ROWS)
    path.write_text(path.read_text().replace("format: vidur,", "format: vidur, timeout_s: 5,"))
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "workload.timeout_s=5", "does not abort")
    # Nor closed-loop clients, nor turns waiting for answers: replay sends at arrival times.
    path = trace_scenario(tmp_path, ROWS, extra="clients: {concurrency: 2}\n")
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "clients=", "closed-loop clients are simulated only")
    path.write_text("workload: {format: prefix, num_conversations: 3, num_turns: 2, "
                    "arrivals: {qps: 1}, question_tokens: 8, output_tokens: 4}\n"
                    "replica: {model: tiny, kv_cache: {block_size: 16, num_blocks: 64}}\n")
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "workload.wait_for_answer=True", "simulated only")
    path = trace_scenario(tmp_path, ROWS)
    if not torch.cuda.is_available():
        code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--device", "cuda")
        assert_one_line_error(code, err, "--device='cuda'", "CUDA is not available")
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--device", "tpu")
    assert_one_line_error(code, err, "--device='tpu'")
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--seed", str(2**63))
    assert_one_line_error(code, err, "--seed=9223372036854775808", "2**63 - 1")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch", None)  # as if torch were not installed
        code, err = run_cli(m, capsys, "replay", str(path))
        assert_one_line_error(code, err, "needs torch")


@pytest.mark.slow
def test_interrupt_keeps_what_ran_marked_incomplete(tmp_path):
    """SIGINT mid-replay: exit 130, results written, run.complete false, every request kept,
    those not done with the reason `interrupted`."""
    rows = [(0.1 * i, 50, 30) for i in range(400)]  # 40 s of arrivals, well within capacity
    path = trace_scenario(tmp_path, rows, num_blocks=512)
    out = tmp_path / "replay"
    proc = subprocess.Popen([sys.executable, "-m", "sim", "replay", str(path), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"}, preexec_fn=sigint_default)
    assert proc.stderr is not None
    # Interrupted once a request is done, as its progress line (every 10 s when not on a
    # terminal) says: a fixed wait after it started failed on a busy machine, where none had
    # finished yet.
    seen = read_until(proc.stderr, r": progress [1-9]\d*/400 requests")
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen, stdout, stderr)
    assert "Traceback" not in stderr and "interrupted" in stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["complete"] is False
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 400
    assert (requests["status"] == "finished").sum() > 0
    unfinished = requests[requests["status"] != "finished"]
    # In progress or queued at the stop, or arriving after it (never offered: left out of the
    # overload test and the SLO shares, which would otherwise read them as a growing queue).
    assert len(unfinished)
    assert unfinished["reason"].str.startswith(("interrupted", "after_stop")).all()
    reasons = summary["requests"]["reasons"]
    assert set(reasons) <= {"interrupted", "after_stop"}
    assert sum(reasons.values()) == len(unfinished)
    # Never offered, requests after the stop are left out of the overload test: counted, they
    # would be a queue growing at the arrival rate. (Whether the replay kept up before the
    # stop is the machine's doing: served in real time, a busy machine may fall a few percent
    # behind over a quarter of the arrivals, and the verdict rightly says so.)
    never_offered = requests["reason"].fillna("").str.startswith("after_stop").to_numpy(bool)
    assert never_offered.any()
    assert (arrived_mask(requests) == ~never_offered).all()
    # Served in real time: on a machine too loaded to keep up (load 15-20 on 2 cores seen),
    # the queue rightly grows and the verdict says so; where nearly every request offered was
    # scheduled, a growth near the arrival rate could only be the requests never offered.
    offered = requests[~never_offered]
    if offered["first_scheduled_s"].notna().mean() > 0.9:
        assert summary["overload"].get("growth_share_of_arrivals", 0.0) < 0.5, \
            summary["overload"]


def test_a_cpu_replay_says_its_verdict_and_prices_no_gpu(tmp_path, monkeypatch, capsys):
    """The replay's table is followed by its overload verdict, as a simulation's is; served on
    the CPU, it has no H100 price (the scenario's default GPU)."""
    path = trace_scenario(tmp_path, ROWS)
    code, out = run_cli_out(monkeypatch, capsys, "replay", str(path), "--out",
                            str(tmp_path / "o"))
    assert code == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["run"]["gpu"].startswith("cpu: ")
    assert "latency_device_note" not in summary["run"]
    verdict = summary["overload"]
    assert f"{verdict['verdict']}: " in out
    cost = summary["cost"]
    assert cost["usd_per_million_tokens"] is None and cost["usd_per_hour"] is None
    Results.load(tmp_path / "o")  # read back as every reader does (`sim.results.read`)
    assert "cost $/M tokens" not in out
    assert f"cost: none (served on {summary['run']['gpu']}, not on h100-sxm" in " ".join(
        out.split())


TINY_MOE = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 2048,
            "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}


def test_a_model_the_decoder_cannot_build_is_refused(tmp_path, monkeypatch, capsys):
    """The decoder is dense with grouped-query attention: a mixture of experts (a tiny Mixtral
    replayed as a dense model of one expert's width, silently) or latent attention is one line,
    before anything is built or measured."""
    config = tmp_path / "moe" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_MOE))
    path = trace_scenario(tmp_path, ROWS)
    path.write_text(path.read_text().replace("model: tiny", f"model: {config}"))
    out = tmp_path / "o"
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out", str(out))
    assert_one_line_error(code, err, "replica.model=", "mixture of experts", "dense")
    assert not out.exists()
    code, err = run_cli(monkeypatch, capsys, "profile", "--model", "deepseek-v2-lite", "--out",
                        str(tmp_path / "p.parquet"), "--max-context", "64", "--max-tokens", "8",
                        "--max-batch", "1", "--holdout", "1", "--reps", "1", "--warmup", "0")
    assert_one_line_error(code, err, "--model='deepseek-v2-lite'", "mixture of experts")
    assert not (tmp_path / "p.parquet").exists()


def test_a_model_too_big_for_this_machine_is_refused_before_it_is_built(tmp_path, monkeypatch,
                                                                        capsys):
    """Only the KV pool was checked: llama-2-70b (276 GB of float32 weights on the CPU, a tiny
    pool) started building until the machine ran out of memory. Weights and pool are checked
    together, before anything is allocated, by replay, validate and profile."""
    path = trace_scenario(tmp_path, ROWS, num_blocks=4)
    path.write_text(path.read_text().replace("model: tiny", "model: llama-2-70b, gpu: mi300x"))
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "replica.model='llama-2-70b'",
                          "weights (275.9 GB in float32)", "do not fit")
    code, err = run_cli(monkeypatch, capsys, "validate", str(path), "--out", str(tmp_path / "v"))
    assert_one_line_error(code, err, "replica.model='llama-2-70b'", "do not fit")
    code, err = run_cli(monkeypatch, capsys, "profile", "--model", "llama-2-70b", "--out",
                        str(tmp_path / "p.parquet"), "--max-context", "64", "--max-tokens", "8",
                        "--max-batch", "1", "--holdout", "1", "--reps", "1", "--warmup", "0")
    assert_one_line_error(code, err, "--model='llama-2-70b'", "weights (275.9 GB", "do not fit")
    assert not {p.name for p in tmp_path.iterdir()} & {"o", "v", "p.parquet"}


def test_the_report_of_a_replay_says_it_was_measured(tmp_path, monkeypatch, capsys):
    """`servesim report` of a replay showed it as a simulation (its resolved scenario's
    roofline latency, a 'simulated span'), without the forward and host times, the machine or
    that its timings were measured and differ from one replay to the next."""
    out = tmp_path / "o"
    code, _ = run_cli_out(monkeypatch, capsys, "replay", str(trace_scenario(tmp_path, ROWS)),
                          "--out", str(out))
    assert code == 0
    code, _ = run_cli_out(monkeypatch, capsys, "report", str(out))
    assert code == 0
    page = (out / "report.html").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert "Replay: measured, not simulated" in page
    assert f"Served for real on {summary['replay']['device_name']}" in page
    assert "another replay of the same scenario and seed gives other timings" in page
    assert "forward pass" in page and "host time around it" in page


def test_a_replay_of_arrivals_years_apart_is_refused_before_it_starts(tmp_path, monkeypatch,
                                                                      capsys):
    """Arrivals years apart waited in real time until killed (issue 49): refused in one line
    before any set-up, naming the span; cut by a horizon, the replay runs."""
    rows = [(0.0, 20, 2), (0.01, 20, 2), (3.2e7, 20, 2), (6.4e7, 20, 2), (9.6e7, 20, 2)]
    path = trace_scenario(tmp_path, rows)
    with within(120):  # refused, not waited for (the bound fails a hang, not a slow run)
        code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out",
                            str(tmp_path / "o"))
    assert_one_line_error(code, err, "workload", "9.6e+07 s", "at most a day", "horizon_s")
    assert not (tmp_path / "o").exists()
    path = trace_scenario(tmp_path, rows, extra="horizon_s: 1.0\n")
    served = replay(load_scenario(path), out_dir=tmp_path / "cut")
    assert served.summary["requests"]["total"] == 5
    assert (served.requests["status"] == "finished").sum() == 2


def test_an_interrupt_during_set_up_says_nothing_was_written(tmp_path, monkeypatch, capsys):
    """Ctrl-C before the replay serves (loading, the model's warm-up) exited 130 without a
    word (issue 49): it says so, and writes nothing."""
    import profiler.replay.serve as serve

    def interrupted_set_up(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve, "replay", interrupted_set_up)
    path = trace_scenario(tmp_path, ROWS)
    code, err = run_cli(monkeypatch, capsys, "replay", str(path), "--out", str(tmp_path / "o"))
    assert code == 130
    assert "interrupted: before the replay's results were written" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
