"""Bad input: one line naming file, field and value; exit code 2; never a traceback."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from sim.config.errors import InputError
from tests.helpers import REPO, assert_one_line_error, run_cli, run_cli_out

VALID_TRACE = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,2\n0.5,20,3\n"


def scenario_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def trace_file(tmp_path: Path, text: str = VALID_TRACE) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def vidur(trace: Path, replica: str = "") -> str:
    return f"workload: {{format: vidur, path: {trace}}}\n{replica}"


CASES = {
    "malformed yaml": ("workload: {format: vidur, path: x\nseed: [", ["<yaml>", "line"]),
    "unknown top-level key": ("workload: {format: vidur, path: x.csv}\nsead: 3\n",
                              ["sead", "Extra inputs"]),
    "unknown scheduler key": (
        "workload: {format: vidur, path: x.csv}\n"
        "replica: {scheduler: {name: chunked_prefill, tokn_budget: 5}}\n",
        ["replica.scheduler.tokn_budget", "5"]),
    "unknown scheduler": ("workload: {format: vidur, path: x.csv}\n"
                          "replica: {scheduler: {name: fancy}}\n",
                          ["replica.scheduler", "fancy", "prefill_first"]),
    "unknown format": ("workload: {format: parquetish, path: x}\n",
                       ["workload", "parquetish", "azure"]),
    "unknown model": ("workload: {format: vidur, path: x.csv}\nreplica: {model: gpt-9}\n",
                      ["replica.model", "gpt-9", "llama-3-8b"]),
    "budget below max_num_seqs": (
        "workload: {format: vidur, path: x.csv}\n"
        "replica: {scheduler: {name: chunked_prefill, token_budget: 64, max_num_seqs: 65}}\n",
        ["replica.scheduler", "max_num_seqs"]),
    "negative seed": ("seed: -1\nworkload: {format: vidur, path: x.csv}\n", ["seed", "-1"]),
    "not a mapping": ("- 1\n- 2\n", ["<top level>", "list"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_scenario(tmp_path, monkeypatch, capsys, case):
    text, needles = CASES[case]
    path = scenario_file(tmp_path, text)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, str(path), *needles)


def test_missing_scenario_file(tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "simulate", str(tmp_path / "nope.yaml"))
    assert_one_line_error(code, err, "nope.yaml", "file not found")


def test_missing_trace_file(tmp_path, monkeypatch, capsys):
    path = scenario_file(tmp_path, vidur(tmp_path / "absent.csv"))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, "absent.csv", "workload.path", "file not found")


@pytest.mark.parametrize("trace,needles", [
    ("arrived_at,num_prefill_tokens\n0.0,10\n", ["column 'num_decode_tokens'", "missing"]),
    (VALID_TRACE + "1.0,-5,3\n", ["num_prefill_tokens (line 4)", "=-5", "positive integer"]),
    (VALID_TRACE + "1.0,12.5,3\n", ["num_prefill_tokens (line 4)", "=12.5:"]),
    (VALID_TRACE + "1.0,12,abc\n", ["num_decode_tokens (line 4)", "'abc'"]),
    (VALID_TRACE + "0.2,12,3\n", ["arrived_at (line 4)", "must not decrease"]),
])
def test_bad_trace_contents(tmp_path, monkeypatch, capsys, trace, needles):
    trace_path = trace_file(tmp_path, trace)
    path = scenario_file(tmp_path, vidur(trace_path))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, str(trace_path), *needles)


def test_model_that_does_not_fit_the_gpu(tmp_path, monkeypatch, capsys):
    path = scenario_file(tmp_path, vidur(trace_file(tmp_path),
                                         "replica: {kv_cache: {gpu_memory_utilization: 0.2}}\n"))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, "replica.kv_cache", "no room for KV")
    # One unit throughout: the activations' 2 GB (the field's unit) said as GiB beside the rest.
    assert "1.9 GiB for activations (activation_reserve_gb 2)" in err and " GB " not in err


def test_the_installed_command_reports_errors_the_same_way(tmp_path):
    path = scenario_file(tmp_path, "workload: {format: vidur, path: x.csv}\nsead: 3\n")
    proc = subprocess.run([sys.executable, "-m", "sim", "simulate", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "sead")


CLUSTER_CASES = {
    "zero replicas in a pool": (
        "cluster: {prefill: {replicas: 0}, decode: {replicas: 1}}\n",
        ["cluster.prefill.replicas", "=0", "greater than 0"]),
    "link without bandwidth": (
        "cluster: {prefill: {replicas: 1}, decode: {replicas: 1}, link: {bandwidth_gb_s: 0}}\n",
        ["cluster.link.bandwidth_gb_s", "=0"]),
    "only a prefill pool": ("cluster: {prefill: {replicas: 1}}\n", ["cluster", "decode pool"]),
    # Transfers so slow that the run passes 2**32 s: the link is at fault, not the latency
    # model the engine's own check of iteration times would name.
    "a link too slow for the clock": (
        "cluster: {prefill: {replicas: 1}, decode: {replicas: 1},\n"
        "          link: {bandwidth_gb_s: 1.0e-14}}\n",
        ["cluster.link=", "bandwidth_gb_s", "past 2**32 s"]),
    "a link latency beyond the clock": (
        "cluster: {prefill: {replicas: 1}, decode: {replicas: 1},\n"
        "          link: {latency_s: 1.0e+12}}\n",
        ["cluster.link=", "latency_s", "past 2**32 s"]),
    "unknown router": ("cluster: {replicas: 2, router: {name: fastest}}\n",
                       ["cluster.router", "fastest", "least_kv_load"]),
    "pools of different models": (
        "cluster: {prefill: {replica: {model: llama-2-7b}}, decode: {replica: {model: tiny}}}\n",
        ["cluster", "same model"]),
}


@pytest.mark.parametrize("case", CLUSTER_CASES)
def test_bad_cluster(tmp_path, monkeypatch, capsys, case):
    text, needles = CLUSTER_CASES[case]
    path = scenario_file(tmp_path, vidur(trace_file(tmp_path), text))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, str(path), *needles)


def test_pool_model_that_does_not_fit_its_gpu(tmp_path, monkeypatch, capsys):
    text = ("cluster:\n  prefill: {replicas: 1}\n"
            "  decode: {replicas: 1, replica: {gpu: a100-80gb, kv_cache: "
            "{gpu_memory_utilization: 0.2}}}\n")
    path = scenario_file(tmp_path, vidur(trace_file(tmp_path), text))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, "cluster.decode.replica.kv_cache", "no room for KV")


def test_an_input_error_holds_several_problems_one_line_each():
    exc = InputError.many("s.yaml", [("seed", True, "must be a number"),
                                     ("workload.qps", float("nan"), "must be finite")])
    assert exc.lines() == ["s.yaml: seed=True: must be a number",
                           "s.yaml: workload.qps=nan: must be finite"]
    assert exc.one_line() == exc.lines()[0]
    assert (exc.field, exc.value, exc.problem) == ("seed", True, "must be a number")
    moved = exc.moved("cmp.yaml", lambda field: f"variants.a.{field}")
    assert moved.lines()[1] == "cmp.yaml: variants.a.workload.qps=nan: must be finite"


@pytest.mark.parametrize("value", [3, "text", [1, 2], threading.Lock(), (x for x in ()),
                                   lambda: None])
def test_input_errors_survive_pickling_with_any_value(value):
    exc = InputError.many(Path("t.csv"), [("col (line 3)", value, "bad"), ("x", 1, "worse")])
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, InputError)
    assert back.lines() == exc.lines() and back.source == "t.csv"
    single = InputError(None, "--seed", value, "bad")
    assert pickle.loads(pickle.dumps(single)).lines() == single.lines()


def test_several_problems_in_a_sweep_worker_come_back_whole(tmp_path):
    # A worker process raises; the error crosses the process boundary pickled.
    with ProcessPoolExecutor(1) as pool:
        future = pool.submit(raise_input_error, str(tmp_path / "s.yaml"))
        with pytest.raises(InputError) as caught:
            future.result(timeout=60)
    assert caught.value.lines() == [f"{tmp_path / 's.yaml'}: a=<lambda>: first",
                                    f"{tmp_path / 's.yaml'}: b=2: second"]


def raise_input_error(source: str) -> None:
    class Unpicklable:
        def __repr__(self) -> str:
            return "<lambda>"

        def __reduce__(self):
            raise TypeError("cannot pickle")

    raise InputError.many(source, [("a", Unpicklable(), "first"), ("b", 2, "second")])


def test_a_key_given_twice_is_an_error(tmp_path, monkeypatch, capsys):
    path = scenario_file(tmp_path, vidur(trace_file(tmp_path),
                                         "replica:\n  scheduler: {name: chunked_prefill, "
                                         "token_budget: 256, token_budget: 2048}\n"))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, "replica.scheduler.token_budget", "line 3", "twice")


def test_a_latency_model_predicting_no_time_is_an_error(tmp_path, monkeypatch, capsys):
    """A fitted profile whose every term is zero passes its file checks; the engine refuses
    its first zero-second iteration (raised inside a SimPy process, still one line)."""
    fitted = json.loads((REPO / "profiles" / "cpu_tiny.json").read_text())
    fitted["knot_s"] = [0.0] * len(fitted["knot_s"])
    fitted["coef"] = dict.fromkeys(fitted["coef"], 0.0)
    profile = tmp_path / "zero.json"
    profile.write_text(json.dumps(fitted))
    path = scenario_file(tmp_path, vidur(trace_file(tmp_path),
                                         f"replica: {{model: tiny, latency: {{kind: profile, "
                                         f"path: {profile}}}, kv_cache: {{num_blocks: 100}}}}\n"))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, "replica.latency", "zero.json", "finite, positive time")


@pytest.mark.parametrize("out", ["", ".", ".."])
def test_out_that_is_the_working_directory_is_refused(tmp_path, monkeypatch, capsys, out):
    path = scenario_file(tmp_path, vidur(trace_file(tmp_path)))
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", out)
    assert_one_line_error(code, err, "--out", "current directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "trace.csv"]


def test_plot_out_that_is_a_file_is_an_error(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    code, _ = run_cli_out(monkeypatch, capsys, "simulate",
                         str(scenario_file(tmp_path, vidur(trace_file(tmp_path)))),
                         "--out", str(run))
    assert code == 0
    (tmp_path / "figures").write_text("")
    code, err = run_cli(monkeypatch, capsys, "plot", str(run), "--out", str(tmp_path / "figures"))
    assert_one_line_error(code, err, "--out", "not a directory")

