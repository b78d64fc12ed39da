"""Start-up of the command line: which modules `servesim --help`, `servesim list` and a command's
`--help` import. Structural, not timed (`python bench/startup.py` times them): pandas, pyarrow,
matplotlib, scipy, ray, torch and the profiler are imported only inside the functions that use
them, and the top-level help builds no scenario model (no sim.config.scenario, so no numpy either).
And `sim` imports and runs without torch.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, imported_by, probe
from tests.helpers import cli_code as cli


def test_sim_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from sim import run_scenario\n"
            "r = run_scenario()\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(r.summary['requests']['finished'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2000"


HEAVY = ("pandas", "matplotlib", "scipy", "pyarrow", "ray", "torch", "profiler")


# What the top-level help needs none of: sim.config.scenario brings numpy, pydantic and every model.
NOT_FOR_HELP = (*HEAVY, "numpy", "sim.config.scenario")


def test_importing_the_app_imports_nothing_heavy():
    assert imported_by("import sim.cli.app", NOT_FOR_HELP) == []


def test_top_level_help_imports_nothing_heavy():
    assert imported_by(cli("--help"), NOT_FOR_HELP) == []


@pytest.mark.parametrize("args", [("list",), ("simulate", "--help"), ("sweep", "--help"),
                                  ("profile", "--help"), ("plot", "--help")],
                         ids=" ".join)
def test_commands_start_without_heavy_imports(args):
    assert imported_by(cli(*args), HEAVY) == []


@pytest.mark.parametrize("args", [("--help",), ("simulate", "--help"), ("sweep", "--help"),
                                  ("plan", "--help")], ids=" ".join)
def test_help_imports_no_pydantic(args):
    """A command's help validates nothing: pydantic (30-40 ms to import, more to build a model)
    stays out. typer 0.29 imports it and builds a TypeAdapter for the help option itself (80-90
    ms on `simulate --help`): pyproject.toml keeps typer below 0.29."""
    assert imported_by(cli(*args), ("pydantic",)) == []


def test_list_builds_no_scenario_model():
    assert imported_by(cli("list"), ("sim.config.scenario", *HEAVY)) == []


# What a simulation written to parquet needs none of: its tables are numpy columns, written by
# pyarrow (importing pandas took longer than simulating 1,000 requests; issue 14).
NOT_FOR_SIMULATE = tuple(m for m in HEAVY if m != "pyarrow")


@pytest.mark.parametrize("scenario", [None, "bench/vidur_1k.yaml"], ids=["default", "vidur_1k"])
def test_simulate_imports_no_pandas(scenario, tmp_path):
    """Generated workloads (the embedded default, the Vidur benchmark); CSV traces are
    covered by tests/workloads/test_table_csv.py."""
    run = cli("simulate", *([scenario] if scenario else []), "--out", str(tmp_path / "run"),
              "--set", "horizon_s=5")
    assert imported_by(run, NOT_FOR_SIMULATE) == []
    assert (tmp_path / "run" / "requests.parquet").is_file()


def test_the_probe_sees_an_import():
    """The checks can fail: code that does import pandas is seen doing so."""
    assert "pandas" in imported_by("import sim.results.read", HEAVY)


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("3", "3")])
def test_numpy_blas_threads(given, expected):
    """The command line starts numpy's OpenBLAS with one thread (its spinning threads cost a busy
    2-core VM 40-60 ms per start-up), unless the user chose a number."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    assert probe(cli("list"), "os.environ.get('OPENBLAS_NUM_THREADS')", env) == expected


def test_simpy_and_torch_stay_where_the_architecture_puts_them():
    """SimPy only in the clock, the engine (the replica, and its steps with a CPU tier), the
    pipelined replica and the disaggregation module; torch nowhere under sim/."""
    sim_dir = REPO / "sim"
    found: dict[str, set[str]] = {"simpy": set(), "torch": set()}
    for path in sim_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                if top in found:
                    found[top].add(path.relative_to(sim_dir.parent).as_posix())
    assert found["simpy"] == {"sim/engine/clock.py", "sim/engine/replica.py",
                              "sim/engine/offload_steps.py", "sim/engine/pipeline.py",
                              "sim/engine/data_parallel.py", "sim/engine/disaggregation.py"}
    assert not found["torch"]


def test_reading_a_run_back_imports_no_engine(tmp_path):
    """Notebooks, plots and reports read result files through `sim.Results`: loading a run
    imports neither SimPy nor the engine, the cluster or the runner."""
    from sim import load_scenario, run_scenario

    scenario = load_scenario()  # the embedded default: the Azure conversation trace
    workload = scenario.workload.model_copy(update={"num_requests": 5})
    run_scenario(scenario.model_copy(update={"workload": workload}), out_dir=tmp_path / "run")
    code = f"from sim import Results\nresults = Results.load({str(tmp_path / 'run')!r})"
    assert imported_by(code, ("simpy", "sim.engine.replica", "sim.runner",
                              "sim.engine.cluster")) == []
    assert probe(code, "len(results.requests)") == 5


def test_list_imports_no_policy_and_no_numpy():
    """`servesim list` reads the policies' names from their source (`sim.core.registry`)."""
    assert imported_by(cli("list"), ("numpy", "sim.schedulers.vllm_v1", "sim.latency.roofline",
                                     "sim.workloads.azure", "sim.routers.vllm_dp")) == []
