"""The notebooks run top to bottom from any working directory, are committed without outputs,
import only servesim's public API, and cache what they compute."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

import sim
from tests.helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 110


def code_cells(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def private_uses(source: str) -> list[str]:
    """What a code cell takes from `sim` beyond its public API: imports of `sim.<module>` or of
    names not in `sim.__all__`, and attributes of `sim` or `sim.plots` outside their own
    `__all__` (`sim.__file__` aside: it locates the checkout)."""
    import sim.plots

    public = {"sim": set(sim.__all__) | {"__file__"}, "plots": set(sim.plots.__all__)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("sim.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sim":
            if node.module != "sim":
                found.append(f"from {node.module} import ...")
            found += [f"sim.{a.name}" for a in node.names if a.name not in sim.__all__]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in public and node.attr not in public[node.value.id]):
            found.append(f"{node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_only_the_public_api(notebook):
    sources = code_cells(notebook)
    assert any("from sim import" in s for s in sources)
    assert [use for s in sources for use in private_uses(s)] == []


def test_the_public_api_check_catches_private_uses():
    code = "from sim.studies.sweep import Run\nimport sim.config.scenario\nfrom sim import Run"
    assert sorted(private_uses(code)) == ["from sim.studies.sweep import ...",
                                          "sim.config.scenario"]
    assert private_uses("from sim import load_workload") == ["sim.load_workload"]
    assert sorted(private_uses("import sim\nsim.runner.collect\nfrom sim import plots\nplots._cdf")
                  ) == ["plots._cdf", "sim.runner"]
    public = "import sim\nfrom sim import plots, run_sweep\nplots.cdfs\nsim.__file__"
    assert private_uses(public) == []


def test_every_public_name_resolves_and_is_documented():
    for name in sim.__all__:
        assert getattr(sim, name) is not None
        assert f"- `{name}" in (sim.__doc__ or ""), name
    assert set(sim.__all__) == {*sim._HOMES, "plots", "traces_dir"}
    # A function named like its module would be hidden by that module once imported.
    for module in ("sim.studies.capacity", "sim.studies.compare"):
        importlib.import_module(module)
    assert callable(sim.search_capacity) and callable(sim.run_comparison)


def test_traces_dir_is_found_from_the_package_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SERVESIM_TRACES", raising=False)
    monkeypatch.chdir(tmp_path)
    assert sim.traces_dir() == (REPO.parent / "shared" / "traces").resolve()
    monkeypatch.setenv("SERVESIM_TRACES", str(tmp_path / "elsewhere"))
    assert sim.traces_dir() == tmp_path / "elsewhere"


def execute(notebook: Path, cwd: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()


@pytest.fixture
def notebook_env(traces, tmp_path, monkeypatch) -> Path:
    """Traces from the fixture, outputs under tmp_path, and a working directory that is
    neither the repository nor the notebooks' folder."""
    monkeypatch.setenv("SERVESIM_TRACES", str(traces))
    monkeypatch.setenv("SERVESIM_NOTEBOOK_OUT", str(tmp_path / "out"))
    (tmp_path / "cwd").mkdir()
    return tmp_path


def computed(out: Path) -> dict[Path, int]:
    """When each capacity search's files and each simulated run's summary were written."""
    files = [*out.glob("capacity/*/*"), *out.glob("*/runs/*/summary.json")]
    return {p: p.stat().st_mtime_ns for p in files}


@pytest.mark.slow
def test_p99_itl_notebook_runs(notebook_env):
    execute(REPO / "notebooks" / "p99_itl.ipynb", notebook_env / "cwd")
    out = notebook_env / "out" / "p99_itl"
    assert (out / "p99_itl_vs_load.png").stat().st_size > 5_000
    assert (out / "results.parquet").is_file()
    assert not any((notebook_env / "cwd").iterdir())


@pytest.mark.slow
def test_colocated_vs_disaggregated_notebook_runs_then_reads_its_cache(notebook_env):
    notebook = REPO / "notebooks" / "colocated_vs_disaggregated.ipynb"
    execute(notebook, notebook_env / "cwd")
    out = notebook_env / "out" / "colocated_vs_disaggregated"
    assert (out / "ttft_tbt_cdfs.png").stat().st_size > 5_000
    searches = sorted((out / "capacity").glob("*/capacity.json"))
    assert len(searches) == 4  # two setups, two SLOs
    for path in searches:
        found = json.loads(path.read_text())
        assert found["num_gpus"] == 4 and found["interval_qps"][0] > 0
    assert len(list(out.glob("one_load/runs/*/summary.json"))) == 2
    written = computed(out)
    execute(notebook, notebook_env / "cwd")
    assert computed(out) == written  # the second run searched and simulated nothing
    assert not any((notebook_env / "cwd").iterdir())
