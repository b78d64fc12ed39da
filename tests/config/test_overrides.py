"""`--set PATH=VALUE`: the dotted-path rule shared with sweep axes, its parsing, its precedence
and its errors, through the real CLI on small scenarios."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sim.config.errors import InputError
from sim.config.overrides import parse_override, set_path
from sim.studies.sweep_file import load_sweep
from tests.helpers import assert_one_line_error, run_cli
from tests.helpers import run_cli_out as cli

SMALL = """\
name: small
workload:
  format: synthetic
  num_requests: 40
  arrivals: {qps: 4}
  lengths:
    prompt: {dist: uniform, low: 10, high: 900}
    output: {dist: uniform, low: 1, high: 40}
replica:
  scheduler: {name: chunked_prefill, token_budget: 512}
"""


def small(tmp_path: Path, text: str = SMALL) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(text)
    return path


def resolved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "scenario.yaml").read_text())


# The rule itself.

def test_set_path_sets_a_copy_creating_mappings_on_the_way():
    data = {"replica": {"scheduler": {"name": "chunked_prefill", "token_budget": 512}}}
    out = set_path(data, "replica.scheduler.token_budget", 256)
    assert out["replica"]["scheduler"] == {"name": "chunked_prefill", "token_budget": 256}
    assert data["replica"]["scheduler"]["token_budget"] == 512  # the input is left alone
    assert set_path({}, "cluster.link.latency_s", 0.1) == {"cluster": {"link": {"latency_s": 0.1}}}


def test_naming_another_registry_entry_starts_its_mapping_afresh():
    data = {"name": "x", "replica": {"scheduler": {"name": "chunked_prefill",
                                                   "token_budget": 512}}}
    out = set_path(data, "replica.scheduler.name", "prefill_first")
    assert out["replica"]["scheduler"] == {"name": "prefill_first"}  # no token_budget left
    same = set_path(data, "replica.scheduler.name", "chunked_prefill")
    assert same["replica"]["scheduler"]["token_budget"] == 512  # the same entry: kept
    # The scenario's own name is a plain field, not a registry key.
    assert set_path(data, "name", "y") == {**data, "name": "y"}


def test_a_parameter_of_a_default_entry_keeps_that_entry():
    defaults = {"replica": {"scheduler": {"name": "chunked_prefill", "token_budget": 512}}}
    out = set_path({}, "replica.scheduler.token_budget", 256, defaults)
    assert out == {"replica": {"scheduler": {"name": "chunked_prefill", "token_budget": 256}}}


@pytest.mark.parametrize(("text", "expected"), [
    ("replica.scheduler.token_budget=512", ("replica.scheduler.token_budget", 512)),
    ("workload.arrivals.qps=2.5", ("workload.arrivals.qps", 2.5)),
    ("replica.scheduler.name=prefill_first", ("replica.scheduler.name", "prefill_first")),
    ("replica.prefix_caching=true", ("replica.prefix_caching", True)),
    ("replica.kv_cache.num_blocks=null", ("replica.kv_cache.num_blocks", None)),
    ("replica.scheduler={name: sglang}", ("replica.scheduler", {"name": "sglang"})),
    ("name=a=b", ("name", "a=b")),  # the first '=' splits
])
def test_values_are_read_as_yaml(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize(("text", "problem"), [
    ("foo", "must be PATH=VALUE"),
    ("=3", "PATH must be field names"),
    ("replica..gpu=h200", "PATH must be field names"),
    ("seed=", "give a value"),
    ("seed=[1", "not YAML"),
    ("seed=[&a 1, *a]", "anchors"),
    # PyYAML's message for a character it refuses spans two lines.
    ("name=a\x01", "unacceptable character #x0001"),
    ("name=a\udcff", "unacceptable character #xdcff"),
])
def test_malformed_overrides_are_refused(text, problem):
    with pytest.raises(InputError) as exc:
        parse_override(text)
    assert exc.value.field == "--set" and problem in exc.value.one_line()
    assert len(exc.value.lines()) == 1 and "\n" not in exc.value.lines()[0]


# simulate

def test_simulate_set_changes_the_scenario_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    code, _ = cli(monkeypatch, capsys, "simulate", str(small(tmp_path)), "--out", str(out),
                  "--set", "replica.scheduler.token_budget=256",
                  "--set", "workload.arrivals.qps=2.5", "--set", "replica.gpu=h200")
    assert code == 0
    data = resolved(out)
    assert data["replica"]["scheduler"]["token_budget"] == 256
    assert data["workload"]["arrivals"]["qps"] == 2.5
    assert data["replica"]["gpu"] == "h200"
    assert json.loads((out / "summary.json").read_text())["run"]["gpu"] == "h200"


def test_simulate_set_on_the_embedded_default_and_a_missing_scheduler(tmp_path, monkeypatch,
                                                                      capsys):
    """No scheduler in the file: its parameter is set on the default scheduler."""
    path = small(tmp_path, SMALL.replace(
        "replica:\n  scheduler: {name: chunked_prefill, token_budget: 512}\n", ""))
    code, _ = cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "a"),
                  "--set", "replica.scheduler.token_budget=128")
    assert code == 0
    assert resolved(tmp_path / "a")["replica"]["scheduler"]["token_budget"] == 128
    code, _ = cli(monkeypatch, capsys, "simulate", "--out", str(tmp_path / "b"),
                  "--set", "workload.num_requests=30", "--set", "replica.kv_cache.block_size=32")
    assert code == 0
    assert resolved(tmp_path / "b")["replica"]["kv_cache"]["block_size"] == 32
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["requests"]["total"] == 30


def test_a_field_inside_a_named_gpu_says_to_give_a_mapping(tmp_path, monkeypatch, capsys):
    """`--set replica.gpu.peak_bf16_flops=...` on a GPU given by name (in the file, or the
    default one) printed every field the new mapping lacked; one line says what to do
    (issue 49). Given as a mapping with `base`, the field is set."""
    for gpu in ("  gpu: h100-sxm\n", ""):
        path = small(tmp_path, SMALL.replace("replica:\n", "replica:\n" + gpu))
        code, err = run_cli(monkeypatch, capsys, "simulate", str(path),
                            "--out", str(tmp_path / "a"),
                            "--set", "replica.gpu.peak_bf16_flops=1.0e+15")
        assert_one_line_error(code, err, "replica.gpu is 'h100-sxm', a name",
                              "replica.gpu={base: h100-sxm, peak_bf16_flops: ...}")
    code, _ = cli(monkeypatch, capsys, "simulate", str(small(tmp_path)), "--out",
                  str(tmp_path / "b"), "--set",
                  "replica.gpu={base: h100-sxm, peak_bf16_flops: 1.0e+15}")
    assert code == 0
    assert resolved(tmp_path / "b")["replica"]["gpu"]["peak_bf16_flops"] == 1.0e15


def test_another_scheduler_by_name_drops_the_old_ones_parameters(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    code, _ = cli(monkeypatch, capsys, "simulate", str(small(tmp_path)), "--out", str(out),
                  "--set", "replica.scheduler.name=prefill_first",
                  "--set", "replica.scheduler.max_num_batched_tokens=4096")
    assert code == 0
    scheduler = resolved(out)["replica"]["scheduler"]
    assert scheduler["name"] == "prefill_first"
    assert scheduler["max_num_batched_tokens"] == 4096


def test_precedence_file_then_set_then_seed(tmp_path, monkeypatch, capsys):
    path = str(small(tmp_path, SMALL + "seed: 1\n"))
    for args, seed in ((["--set", "seed=3"], 3), (["--set", "seed=3", "--seed", "5"], 5),
                       (["--seed", "5", "--set", "seed=3"], 5),
                       (["--set", "seed=3", "--set", "seed=4"], 4)):
        out = tmp_path / "_".join(args).replace("-", "")
        code, _ = cli(monkeypatch, capsys, "simulate", path, "--out", str(out), *args)
        assert code == 0
        assert resolved(out)["seed"] == seed, args


@pytest.mark.parametrize(("given", "needles"), [
    ("foo", ["--set='foo'", "must be PATH=VALUE"]),
    ("replica.schedulr.token_budget=5", ["small.yaml", "--set replica.schedulr.token_budget=5",
                                         "replica.schedulr", "no such field"]),
    ("workload.arrivals.qpss=3", ["--set workload.arrivals.qpss=3", "no such field"]),
    ("replica.scheduler.token_budget=true", ["--set replica.scheduler.token_budget=True",
                                             "not a boolean"]),
    ("seed=-1", ["--set seed=-1", "greater than or equal to 0"]),
    ("replica.scheduler.name=nope", ["--set replica.scheduler.name='nope'",
                                     "unknown scheduler"]),
])
def test_bad_overrides_are_one_line_errors(tmp_path, monkeypatch, capsys, given, needles):
    code, err = run_cli(monkeypatch, capsys, "simulate", str(small(tmp_path)),
                        "--out", str(tmp_path / "r"), "--set", given)
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "r").exists()


# sweep

SWEEP = """\
name: sw
base: small.yaml
grid:
  workload.arrivals.qps: [2, 4]
"""


def sweep(tmp_path: Path, text: str = SWEEP) -> Path:
    small(tmp_path)
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_sweep_set_changes_every_run_and_its_cache_key(tmp_path, monkeypatch, capsys):
    path, out = str(sweep(tmp_path)), str(tmp_path / "out")
    code, _ = cli(monkeypatch, capsys, "sweep", path, "--out", out, "--workers", "1")
    assert code == 0
    plain = pd.read_csv(tmp_path / "out" / "results.csv")
    args = ("sweep", path, "--out", out, "--workers", "1",
            "--set", "replica.scheduler.token_budget=128")
    code, _ = cli(monkeypatch, capsys, *args)
    assert code == 0
    changed = pd.read_csv(tmp_path / "out" / "results.csv")
    assert set(changed["key"]).isdisjoint(plain["key"])  # new keys: the runs ran again
    for key in changed["key"]:
        scenario = resolved(tmp_path / "out" / "runs" / key)
        assert scenario["replica"]["scheduler"]["token_budget"] == 128
    runs = sorted(p.name for p in (tmp_path / "out" / "runs").iterdir())
    code, _ = cli(monkeypatch, capsys, *args)  # the same --set again: cached, no new run
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "out" / "runs").iterdir()) == runs
    assert pd.read_csv(tmp_path / "out" / "results.csv")["key"].tolist() == \
        changed["key"].tolist()


def test_sweep_set_applies_over_an_axis_that_names_another_scheduler(tmp_path):
    path = sweep(tmp_path, SWEEP.replace(
        "grid:\n  workload.arrivals.qps: [2, 4]\n",
        "grid:\n  replica.scheduler.name: [chunked_prefill, vllm_v1]\n"))
    _, runs = load_sweep(path, [parse_override("replica.scheduler.max_num_seqs=8")])
    assert [r.scenario.replica.scheduler.max_num_seqs for r in runs] == [8, 8]
    # vllm_v1 started afresh: chunked_prefill's token_budget was not carried over to it.
    assert runs[1].scenario.replica.scheduler.name == "vllm_v1"


@pytest.mark.parametrize(("text", "given", "axis"), [
    (SWEEP, "workload.arrivals.qps=3", "workload.arrivals.qps"),
    (SWEEP, "workload.arrivals={qps: 3}", "workload.arrivals.qps"),  # a mapping around it
    (SWEEP.replace("workload.arrivals.qps: [2, 4]", "workload.arrivals: [{qps: 2}, {qps: 4}]"),
     "workload.arrivals.qps=3", "workload.arrivals"),
    (SWEEP + "seeds: [0, 1]\n", "seed=3", "seed"),
])
def test_sweep_refuses_a_set_on_a_swept_field(tmp_path, monkeypatch, capsys, text, given, axis):
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep(tmp_path, text)),
                        "--out", str(tmp_path / "out"), "--set", given)
    assert_one_line_error(code, err, f"--set {given.split('=')[0]}", f"the sweep varies {axis}")
    assert not (tmp_path / "out").exists()


def test_sweep_set_seed_without_a_seeds_list_sets_the_one_seed(tmp_path):
    _, runs = load_sweep(sweep(tmp_path), [("seed", 7)])
    assert {r.seed for r in runs} == {7}


def test_sweep_bad_set_names_the_option(tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep(tmp_path)),
                        "--out", str(tmp_path / "out"), "--set", "replica.gpu=nope")
    assert_one_line_error(code, err, "sweep.yaml", "--set replica.gpu='nope'", "unknown gpu")


def test_sweep_backend_is_a_choice(tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "sweep", str(sweep(tmp_path)), "--backend", "dask")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'dask' is not one of 'local', 'ray'" in err


# compare and capacity

COMPARISON = """\
name: cmp
base:
  workload:
    format: synthetic
    num_requests: 30
    arrivals: {qps: 8}
    lengths:
      prompt: {dist: uniform, low: 100, high: 800}
      output: {dist: uniform, low: 5, high: 30}
  replica: {scheduler: {name: chunked_prefill, token_budget: 256}}
variants:
  chunked: {}
  first: {replica: {scheduler: {name: prefill_first}}}
"""


def test_compare_set_reaches_every_variant_over_its_changes(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cmp.yaml"
    path.write_text(COMPARISON)
    out = tmp_path / "r"
    code, _ = cli(monkeypatch, capsys, "compare", str(path), "--out", str(out),
                  "--set", "replica.scheduler.max_num_seqs=4", "--set", "replica.gpu=h200")
    assert code == 0
    for variant, name in (("chunked", "chunked_prefill"), ("first", "prefill_first")):
        data = resolved(out / variant)
        assert data["replica"]["scheduler"]["name"] == name
        assert data["replica"]["scheduler"]["max_num_seqs"] == 4
        assert data["replica"]["gpu"] == "h200"
    code, err = run_cli(monkeypatch, capsys, "compare", str(path), "--out", str(out),
                        "--set", "replica.scheduler.token_budget=64")
    # prefill_first has no token_budget: named by the option, not by the variant.
    assert_one_line_error(code, err, "cmp.yaml", "--set replica.scheduler.token_budget=64",
                          "no such field")


def test_capacity_set_changes_the_searched_scenario(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cap"
    code, _ = cli(monkeypatch, capsys, "capacity", str(small(tmp_path)), "--tbt-p99", "0.05",
                  "--replications", "1", "--precision", "0.3", "--out", str(out),
                  "--set", "workload.arrivals.qps=3", "--set", "workload.num_requests=30")
    assert code == 0
    trials = pd.read_csv(out / "trials.csv")
    assert trials["rate"].iloc[0] == 3  # the search starts at the rate --set gave
    code, err = run_cli(monkeypatch, capsys, "capacity", str(small(tmp_path)), "--tbt-p99",
                        "0.05", "--set", "replica.scheduler.token_budjet=64")
    assert_one_line_error(code, err, "--set replica.scheduler.token_budjet=64", "no such field")
