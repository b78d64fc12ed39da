"""The `vllm_bench` format: a `vllm bench serve` result file's requests as sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.workloads.load import load_workload

RESULT = {"start_times": [0.5, 0.0, 1.25], "input_lens": [100, 200, 300],
          "output_lens": [10, 20, 0], "ttfts": [0.1, 0.1, 0.0]}


def load(tmp_path: Path, data: Any, **fields: Any):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return load_workload(parse_scenario(
        {"workload": {"format": "vllm_bench", "path": str(path), **fields}}, "s.yaml"))


def test_requests_in_send_order_failed_ones_refused_or_skipped(tmp_path: Path):
    with pytest.raises(InputError) as err:
        load(tmp_path, RESULT)
    assert err.value.field == "output_lens" and "failed: skip" in err.value.problem
    w = load(tmp_path, RESULT, failed="skip")
    np.testing.assert_array_equal(w.arrival_s, [0.0, 0.5])
    np.testing.assert_array_equal(w.num_prompt_tokens, [200, 100])
    np.testing.assert_array_equal(w.num_output_tokens, [20, 10])


@pytest.mark.parametrize(("change", "field"), [
    ({"start_times": None}, "start_times"),
    ({"input_lens": [100, "x", 3]}, "input_lens"),
    ({"input_lens": [100, 0, 3]}, "input_lens"),
    ({"output_lens": [1, 2.5, 3]}, "output_lens"),
    ({"start_times": [0.0, -1.0, 2.0]}, "start_times"),
    ({"output_lens": [1, 2]}, "output_lens"),
])
def test_a_bad_result_is_one_line_naming_its_key(tmp_path: Path, change: dict[str, Any],
                                                   field: str):
    data = {k: v for k, v in {**RESULT, "output_lens": [1, 2, 3], **change}.items()
            if v is not None}
    with pytest.raises(InputError) as err:
        load(tmp_path, data)
    assert err.value.field == field and err.value.source.endswith("bench.json")
