"""Helpers shared by tests in several packages: factories of requests and replica states,
running the CLI in-process, small scenarios and traces written to a test's folder, prefix-cached
states, and probes of what a fresh interpreter imports."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import IO

import numpy as np
import pytest
import yaml

from sim import run_scenario, traces_dir
from sim.cli import main
from sim.config.scenario import parse_scenario
from sim.core.block_cache import BlockPrefixCache
from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.radix_cache import PrefixCachingKVManager
from sim.core.request import Request, Status
from sim.core.state import ReplicaState

REPO = Path(__file__).resolve().parents[1]
# Tests of what runs torch (the profiler's measure and replay, and what imports them): skipped,
# with this reason, where torch is not installed.
requires_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                    reason="needs torch: pip install -e '.[profile]'")
TRACES = traces_dir()  # the rule the notebooks and benchmarks use



def sigint_default() -> None:
    """`preexec_fn` for a child a test sends SIGINT: SIGINT at its default, as a shell starts a
    foreground job. A suite started in the background without job control (`cmd &` in a
    script, as CI runners may) ignores SIGINT, every child inherits that, and Python then
    installs no KeyboardInterrupt: the child would run on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

def make_request(request_id: int, prompt: int, output: int, *, arrival_s: float = 0.0,
                 generated: int = 0) -> Request:
    """A request; with `generated` > 0 it has already prefilled and sampled that many tokens."""
    req = Request(request_id, arrival_s, prompt, output)
    if generated:
        req.num_output_tokens = generated
        req.num_computed_tokens = prompt + generated - 1
    return req


def make_state(num_blocks: int = 1000, block_size: int = 16, running: tuple[Request, ...] = (),
               waiting: tuple[Request, ...] = ()) -> ReplicaState:
    """A replica state with `running` requests already admitted (blocks allocated)."""
    state = ReplicaState(KVCacheManager(num_blocks, block_size))
    for req in running:
        state.add(req)
        assert state.kv.try_allocate(req, 0)  # blocks for the tokens it has computed
        state.admit(req)
    for req in waiting:
        state.add(req)
    return state


class Stepper:
    """Runs schedule/commit without SimPy, one unit of time per iteration."""

    def __init__(self, scheduler, state: ReplicaState) -> None:
        self.scheduler = scheduler
        self.state = state
        self.iteration = 0

    def step(self) -> Plan:
        plan = self.scheduler.schedule(self.state, float(self.iteration))
        self.state.check()
        self.state.commit(plan, self.iteration, float(self.iteration), float(self.iteration + 1))
        self.state.check()
        self.iteration += 1
        return plan


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["servesim", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


def run_cli_out(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run the CLI in-process: its exit code (0 if it returned) and what it printed on stdout."""
    monkeypatch.setattr(sys, "argv", ["servesim", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().out


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def is_finished(req: Request) -> bool:
    return req.status is Status.FINISHED


def load_script(path: Path, name: str) -> ModuleType:
    """A script that is not a package module (a benchmark under bench/), imported by path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Clusters of the tiny model with the constant latency model (exact timestamps).
TICK = 0.25


TINY_KV_BYTES = 2048  # tiny model: 4 layers x 2 KV heads x 64 x (K, V) x 2 bytes


def trace(tmp_path: Path, rows: list[tuple[float, int, int]]) -> str:
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    return str(path)


def replica(num_blocks: int = 1000, **scheduler) -> dict:
    return {"model": "tiny",
            "scheduler": {"name": "chunked_prefill", "token_budget": 256, "max_num_seqs": 16,
                          **scheduler},
            "latency": {"kind": "constant", "iteration_s": TICK},
            "kv_cache": {"block_size": 16, "num_blocks": num_blocks}}


def disaggregated(tmp_path, rows, *, prefill=None, decode=None, link=None, **extra):
    return parse_scenario({
        "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
        "cluster": {"prefill": {"replicas": 1, "replica": prefill or replica()},
                    "decode": {"replicas": 1, "replica": decode or replica()},
                    "link": link or {"bandwidth_gb_s": 0.0004096, "latency_s": 0.0}},
        "record_token_times": True, **extra}, "test")


def colocated_run(tmp_path: Path, *, record_token_times: bool = True,
                  slo: dict | None = None) -> Path:
    """One replica, a 2.6 s horizon: finished, rejected (prompt beyond the KV cache), running
    and queued requests."""
    rows = sorted([(0.1 * i, 30 + 7 * i, 2 + i % 5) for i in range(12)] + [(0.5, 400, 3)])
    scenario = parse_scenario({
        "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
        "replica": replica(num_blocks=20, token_budget=64, max_num_seqs=4),
        "horizon_s": 2.6, "record_token_times": record_token_times, "slo": slo or {}}, "test")
    out = tmp_path / "colocated"
    run_scenario(scenario, out_dir=out)
    return out


def disaggregated_run(tmp_path: Path) -> Path:
    """1 prefill + 1 decode replica (the exact timings of tests/engine/test_disaggregation.py),
    two transfers queueing."""
    out = tmp_path / "disaggregated"
    run_scenario(disaggregated(tmp_path, [(0.0, 100, 3), (0.125, 40, 2), (0.3, 50, 5)]),
                 out_dir=out)
    return out


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail, rather than hang the suite, if the block blocks (on a named pipe)."""
    def expire(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def hashed(request_id: int, prompt: int, output: int, ids: tuple[int, ...], unit: int = 32
           ) -> Request:
    return Request(request_id, 0.0, prompt, output, ids, unit)


def cached_state(num_blocks: int = 64, block_size: int = 16, eviction: str = "lru_block"
                 ) -> ReplicaState:
    """vLLM's block cache (`lru_block`, `fifo_block`), or SGLang's radix cache (`lru_leaf`)."""
    if eviction == "lru_leaf":
        return ReplicaState(PrefixCachingKVManager(num_blocks, block_size))
    return ReplicaState(BlockPrefixCache(num_blocks, block_size, eviction))  # type: ignore[arg-type]


def serve(state: ReplicaState, req: Request) -> int:
    """Admit `req` for its whole prompt (after its hit) and finish it; return the hit."""
    kv = state.kv
    state.add(req)
    hit = kv.prefix_hit_tokens(req)
    assert kv.try_allocate(req, req.num_prompt_tokens - hit, 0, hit)
    state.admit(req, hit)
    req.num_computed_tokens = req.num_prompt_tokens
    state.finish(req, 0.0)
    kv.check()
    return hit


def csv_replay(tmp_path: Path, *, noise: bool = False) -> Path:
    """A replayed trace: 200 requests every 0.2 s (5 req/s), one token in, one out, served
    alone in 0.1 s: capacity 10 req/s, rate scale 2."""
    trace = tmp_path / "trace.csv"
    trace.write_text("t,p,o\n" + "".join(f"{0.2 * i:.1f},1,1\n" for i in range(200)))
    latency: dict = {"kind": "constant", "iteration_s": 0.1}
    if noise:
        latency["noise"] = {"kind": "lognormal", "sigma": 0.1}
    scenario = {"name": "replay", "workload": {
        "format": "csv", "path": "trace.csv",
        "columns": {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o"}},
        "replica": {"scheduler": {"name": "prefill_first", "max_num_seqs": 1},
                    "latency": latency, "kv_cache": {"num_blocks": 100}}}
    path = tmp_path / ("noisy.yaml" if noise else "replay.yaml")
    path.write_text(yaml.safe_dump(scenario))
    return path


def probe(code: str, expression: str, env: dict[str, str] | None = None) -> object:
    """The value of `expression` in a fresh interpreter after it runs `code`."""
    program = f"{code}\nimport os, sys\nprint('PROBE', repr({expression}))"
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("PROBE "), proc.stdout
    return ast.literal_eval(last.removeprefix("PROBE "))


def imported_by(code: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter has imported after running `code`."""
    found = probe(code, f"sorted(m for m in {watched!r} if m in sys.modules)")
    assert isinstance(found, list)
    return found


def cli_code(*args: str) -> str:
    """Code that runs `servesim ARGS` through its entry point and requires exit code 0."""
    return (f"import sys\nsys.argv = ['servesim', *{list(args)!r}]\nfrom sim.cli import main\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n")


ONE_AT_A_TIME = {
    # Requests of one prompt token and one output token, one at a time, 0.1 s each: the
    # service time is 0.1 s, so the capacity is 10 requests/s. Arrivals nearly periodic.
    "workload": {"format": "synthetic", "num_requests": 300,
                 "arrivals": {"process": "gamma", "qps": 3.0, "cv": 0.02},
                 "lengths": {"prompt": {"dist": "fixed", "value": 1},
                             "output": {"dist": "fixed", "value": 1}}},
    "replica": {"scheduler": {"name": "prefill_first", "max_num_seqs": 1},
                "latency": {"kind": "constant", "iteration_s": 0.1},
                "kv_cache": {"num_blocks": 100}},
}


def read_until(stream: IO[str], pattern: str, timeout_s: int = 300) -> str:
    """The lines of `stream` (a process's pipe) up to the first that matches `pattern` (a
    regular expression): wait for what a process says, not for a fixed time, before acting on
    it. `timeout_s` only guards against a hang; a stream that ends first fails."""
    seen = ""
    with within(timeout_s):
        for line in iter(stream.readline, ""):
            seen += line
            if re.search(pattern, line):
                return seen
    raise AssertionError(f"ended before a line matching {pattern!r}: {seen}")


def max_in_flight(requests) -> int:
    """The most requests of a run's table in flight at once (sent, not yet finished), as
    counted at each send."""
    start, end = np.sort(requests["arrival_s"].to_numpy()), np.sort(requests["finish_s"])
    return int((np.searchsorted(start, start, side="right")
                - np.searchsorted(end, start, side="right")).max())
