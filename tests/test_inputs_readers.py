"""The other readers of a user's file share sim.config.input_file's rules: a communication table and
a model's config.json (bounded, regular files only, strict JSON), and the GEMM calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sim.latency.comm
from sim.config.errors import InputError
from sim.hardware.hf_config import read_config
from sim.latency.comm import read_table
from sim.latency.gemm import load_calibration
from tests.test_models import _config

TABLE = ("time_stats.all_reduce.median,num_workers,size,devices_per_node\n"
         "0.02,2,2048,8\n0.03,2,1048576,8\n")


def test_a_communication_table_is_read_bounded(tmp_path, monkeypatch):
    table = tmp_path / "ar.csv"
    table.write_text(TABLE)
    assert read_table(table, "all_reduce", 2, "f").sizes_bytes.tolist() == [2048, 1048576]
    monkeypatch.setattr(sim.latency.comm, "MAX_TABLE_BYTES", len(TABLE) - 1)
    with pytest.raises(InputError, match=r"ar.csv: f=.*: too large \(more than"):
        read_table(table, "all_reduce", 2, "f")
    with pytest.raises(InputError, match=r"nothing.csv: f=.*: file not found"):
        read_table(tmp_path / "nothing.csv", "all_reduce", 2, "f")


@pytest.mark.parametrize("text,problem", [
    (json.dumps(_config(rms_norm_eps=1.0))[:-1] + ', "rope_theta": NaN}',
     "not JSON (NaN is not a JSON number)"),
    (json.dumps(_config(rms_norm_eps=1.0))[:-1] + ', "rope_theta": 1e999}',
     "the number 1e999 is too large for a float"),
])
def test_a_config_json_is_read_strictly(tmp_path, text, problem):
    # json.loads took NaN and 1e999 (inf) for numbers: a model read with them ran.
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_config(path)
    assert str(info.value) == f"{path.resolve()}: {problem}"


def test_a_calibration_with_nan_is_not_usable(tmp_path: Path) -> None:
    from sim.latency.gemm import CALIBRATION_PATH

    text = CALIBRATION_PATH.read_text()
    launch = json.loads(text)["gpus"]["h100-sxm"]["params"]["launch_s"]
    bad = tmp_path / "gemm.json"
    bad.write_text(text.replace(f'"launch_s": {json.dumps(launch)}', '"launch_s": NaN', 1))
    assert bad.read_text() != text
    with pytest.raises(RuntimeError, match="gemm.json: not a usable GEMM calibration.*NaN"):
        load_calibration(bad)
