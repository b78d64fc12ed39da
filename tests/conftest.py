"""Shared test helpers: tiny factories, and the real traces in ../shared/traces."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

from sim import traces_dir
from sim.cli import main
from sim.core.kv_cache import KVCacheManager
from sim.core.plan import Plan
from sim.core.request import Request, Status
from sim.core.state import ReplicaState

REPO = Path(__file__).resolve().parents[1]
TRACES = traces_dir()  # the rule the notebooks and benchmarks use


@pytest.fixture(autouse=True, scope="session")
def _trace_cache_in_tmp(tmp_path_factory):
    """Parsed-trace cache entries go to a folder of this session, not the user's ~/.cache (a
    user's own SERVESIM_CACHE_DIR is kept)."""
    os.environ.setdefault("SERVESIM_CACHE_DIR", str(tmp_path_factory.mktemp("servesim-cache")))


@pytest.fixture
def traces() -> Path:
    """The shared trace folder. CI sets SERVESIM_REQUIRE_TRACES=1 so that a missing folder fails."""
    if not TRACES.is_dir():
        if os.environ.get("SERVESIM_REQUIRE_TRACES"):
            pytest.fail(f"trace folder {TRACES} is missing")
        pytest.skip(f"trace folder {TRACES} is missing (set SERVESIM_TRACES)")
    return TRACES


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


# CI runs the property tests on a fixed set of examples, so a pass or a failure repeats;
# locally, hypothesis explores new examples on every run.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def load_script(path: Path, name: str) -> ModuleType:
    """A script that is not a package module (a benchmark under bench/), imported by path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
