"""The P99-ITL notebook runs top to bottom, and is committed without outputs."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO

NOTEBOOK = REPO / "notebooks" / "p99_itl.ipynb"


def test_notebook_is_committed_without_outputs():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)


def test_notebook_runs(traces, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("SERVESIM_TRACES", str(traces))
    monkeypatch.setenv("SERVESIM_NOTEBOOK_OUT", str(tmp_path / "out"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=110, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO / "notebooks")}})
    client.execute()
    assert (tmp_path / "out" / "p99_itl_vs_load.png").stat().st_size > 5_000
    assert (tmp_path / "out" / "results.parquet").is_file()
    assert os.environ["SERVESIM_NOTEBOOK_OUT"] == str(tmp_path / "out")
