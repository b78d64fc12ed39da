"""Engine calibrations (`replica.engine`): the shipped default, a file of the user's, `none`;
their latency fields as a roofline's defaults; their front end in client-side latencies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from sim import run_scenario
from sim.config.engine import DEFAULT_CALIBRATION, load_calibration, shipped_names
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario, scenario_yaml

WORKLOAD = {"format": "synthetic", "num_requests": 40, "arrivals": {"qps": 4.0},
            "lengths": {"prompt": {"dist": "fixed", "value": 300},
                        "output": {"dist": "fixed", "value": 30}}}


def scenario(replica: dict[str, Any], base_dir: Path | None = None) -> Any:
    return parse_scenario({"workload": WORKLOAD, "replica": replica}, "test.yaml", base_dir)


def test_auto_is_vllms_calibration_but_for_sglang():
    shipped = load_calibration(DEFAULT_CALIBRATION)
    assert DEFAULT_CALIBRATION in shipped_names() and shipped.error and shipped.provenance
    replica = scenario({}).replica
    assert replica.engine == DEFAULT_CALIBRATION
    for field, value in shipped.latency.items():
        assert getattr(replica.latency, field) == value
    assert replica.frontend_latency_s == shipped.frontend_s > 0
    sglang = scenario({"scheduler": {"name": "sglang"}}).replica
    assert sglang.engine == "none" and sglang.frontend_latency_s == 0.0


def test_given_latency_fields_win_and_none_keeps_the_rooflines_defaults():
    replica = scenario({"latency": {"kind": "roofline", "overhead_s": 0.0}}).replica
    assert replica.latency.overhead_s == 0.0
    plain = scenario({"engine": "none"}).replica
    default = type(plain.latency)(kind="roofline")
    assert plain.latency == default and plain.frontend_latency_s == 0.0
    # Another latency model takes none of the calibration's fields.
    constant = scenario({"latency": {"kind": "constant", "iteration_s": 0.01}}).replica
    assert constant.latency.kind == "constant"


def test_the_resolved_scenario_reads_back_the_same():
    first = scenario({"parallelism": {"tensor": 2}})
    again = parse_scenario(yaml.safe_load(scenario_yaml(first)), "again.yaml")
    assert again.replica == first.replica


def test_a_calibration_file_of_ones_own(tmp_path: Path):
    (tmp_path / "cal").mkdir()
    (tmp_path / "cal" / "mine.yaml").write_text(
        "name: mine\nengine: vllm 0.99\nlatency: {overhead_s: 0.001, mbu: 0.9}\n"
        "frontend_s: 0.01\nfrontend_per_extra_gpu_s: 0.002\n")
    replica = scenario({"engine": "cal/mine.yaml", "parallelism": {"tensor": 4}},
                       tmp_path).replica
    assert replica.engine == tmp_path / "cal" / "mine.yaml"
    assert (replica.latency.overhead_s, replica.latency.mbu) == (0.001, 0.9)
    assert replica.frontend_latency_s == pytest.approx(0.01 + 3 * 0.002)


@pytest.mark.parametrize(("text", "field"), [
    ("name: x\nengine: y\nfrontend_s: -1\n", "frontend_s"),
    ("name: x\nengine: y\nlatency: {mbu: 2.0}\n", "latency.mbu"),
    ("name: x\nengine: y\nlatency: {kind: linear}\n", "latency.kind"),
    ("name: x\nengine: y\nlatency: {nope: 1}\n", "latency.nope"),
    ("name: x\n", "engine"),
    ("- a list\n", "<top level>"),
])
def test_a_bad_calibration_file_is_named_with_its_field(tmp_path: Path, text: str, field: str):
    path = tmp_path / f"bad{abs(hash(text))}.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        scenario({"engine": str(path)})
    assert err.value.source == str(path) and err.value.field == field


def test_an_unknown_calibration_is_one_line_at_its_field():
    with pytest.raises(InputError) as err:
        scenario({"engine": "vllm-9-h900"})
    assert err.value.field == "replica.engine" and DEFAULT_CALIBRATION in err.value.problem
    assert len(err.value.lines()) == 1


def test_client_side_latencies_add_each_replicas_front_end():
    res = run_scenario(scenario({"parallelism": {"tensor": 2}}))
    req = res.requests
    added = load_calibration(DEFAULT_CALIBRATION).frontend_latency_s(2)
    np.testing.assert_allclose(req["client_ttft_s"] - req["ttft_s"], added, rtol=1e-9)
    np.testing.assert_allclose(req["client_e2e_s"] - req["e2e_s"], added, rtol=1e-9)
    s = res.summary
    assert s["client_ttft_s"]["mean"] == pytest.approx(s["ttft_s"]["mean"] + added)
    assert s["client_e2e_s"]["p99"] == pytest.approx(s["e2e_s"]["p99"] + added)
    assert s["run"]["engine"] == DEFAULT_CALIBRATION
    cal = s["latency_model"]["calibration"]
    assert cal["name"] == DEFAULT_CALIBRATION and cal["frontend_s"] == {"colocated": added}
    # The front end moves no token gap.
    shipped = load_calibration(DEFAULT_CALIBRATION).latency
    plain = run_scenario(scenario({"parallelism": {"tensor": 2}, "engine": "none",
                                   "latency": {"kind": "roofline", **shipped}}))
    assert plain.summary["tpot_s"] == s["tpot_s"]
    np.testing.assert_array_equal(plain.requests["client_ttft_s"], plain.requests["ttft_s"])
