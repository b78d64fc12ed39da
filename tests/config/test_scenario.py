"""Scenario validation through the real CLI: every problem of a file at once, strict types,
finite numbers, safe names, impossible or ignored settings refused, YAML files that are not
scenarios, and paths made absolute without resolving symlinks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim.config.errors import InputError
from sim.config.scenario import load_scenario, parse_scenario, scenario_yaml
from tests.helpers import assert_one_line_error, run_cli, trace, within

TRACE = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,2\n0.5,20,3\n"
QUICK = "latency: {kind: constant, iteration_s: 0.01}"


def write_scenario(tmp_path: Path, text: str) -> Path:
    (tmp_path / "trace.csv").write_text(TRACE)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def simulate(tmp_path, monkeypatch, capsys, text: str) -> tuple[int, str, Path]:
    path = write_scenario(tmp_path, text)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    return code, err, path


def test_every_problem_of_a_file_is_reported_at_once(tmp_path, monkeypatch, capsys):
    text = ("seed: true\n"
            "workload: {format: synthetic, num_requests: 5, arrivals: {qps: true},\n"
            "  lengths: {prompt: {dist: fixed, value: 5}, output: {dist: fixed, value: 2}}}\n"
            "replica:\n"
            "  scheduler: {name: chunked_prefill, token_budget: yes}\n"
            "  latency: {kind: constant, iteration_s: .inf}\n")
    code, err, path = simulate(tmp_path, monkeypatch, capsys, text)
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    expected = ["seed=True", "workload.arrivals.qps=True", "replica.scheduler.token_budget=True",
                "replica.latency.iteration_s=inf"]
    assert len(lines) == len(expected), err
    for line, needle in zip(lines, expected, strict=True):
        assert line.startswith(f"error: {path}: {needle}: "), line


STRICT_CASES = {
    "bool budget": ("replica: {scheduler: {name: chunked_prefill, token_budget: yes}, " + QUICK
                    + "}", ["replica.scheduler.token_budget=True", "not a boolean"]),
    "bool qps": ("arrivals: {qps: true}", ["workload.arrivals.qps=True", "not a boolean"]),
    "bool seed": ("seed: true", ["seed=True", "not a boolean"]),
    "text seed": ("seed: '3'", ["seed='3'", "not text"]),
    "yaml reads 1e3 as text": ("arrivals: {qps: 1e3}", ["qps='1e3'", "1.0e+12"]),
    "bool for a bool is fine, a number is not": ("record_token_times: 1",
                                                 ["record_token_times=1", "boolean"]),
    "inf iteration": ("replica: {latency: {kind: constant, iteration_s: .inf}}",
                      ["replica.latency.iteration_s=inf", "finite"]),
    "nan horizon": ("horizon_s: .nan", ["horizon_s=nan", "finite"]),
    "inf slo": ("slo: {ttft_s: .inf}", ["slo.ttft_s=inf", "finite"]),
    "inf rate scale": ("rate_scale: .inf", ["workload.rate_scale=inf", "finite"]),
    "nan mfu": ("replica: {latency: {kind: roofline, mfu: .nan}}",
                ["replica.latency.mfu=nan", "finite"]),
    "zero iteration": ("replica: {latency: {kind: constant, iteration_s: 0}}",
                       ["replica.latency.iteration_s=0", "greater than 0"]),
    "negative iteration": ("replica: {latency: {kind: constant, iteration_s: -0.01}}",
                           ["replica.latency.iteration_s=-0.01"]),
    "mfu above 1": ("replica: {latency: {kind: roofline, mfu: 1.5}}", ["replica.latency.mfu=1.5"]),
    "overhead of hours": ("replica: {latency: {kind: roofline, overhead_s: 3600}}",
                          ["replica.latency.overhead_s=3600"]),
}


def synthetic(extra: str) -> str:
    """A small synthetic scenario; `extra` goes into `arrivals` if it starts so, else on top."""
    arrivals = extra if extra.startswith("arrivals") else "arrivals: {qps: 5}"
    workload = ("workload: {format: synthetic, num_requests: 5, " + arrivals
                + ", lengths: {prompt: {dist: fixed, value: 5}, output: {dist: fixed, value: 2}}"
                + (", " + extra if extra.startswith("rate_scale") else "") + "}\n")
    top = "" if extra.startswith(("arrivals", "rate_scale")) else extra + "\n"
    return workload + top


@pytest.mark.parametrize("case", STRICT_CASES)
def test_strict_types_and_finite_numbers(tmp_path, monkeypatch, capsys, case):
    extra, needles = STRICT_CASES[case]
    code, err, path = simulate(tmp_path, monkeypatch, capsys, synthetic(extra))
    assert_one_line_error(code, err, str(path), *needles)


def test_ints_for_floats_and_strings_for_paths_still_load(tmp_path):
    path = write_scenario(tmp_path, "workload: {format: vidur, path: trace.csv, rate_scale: 2}\n"
                          "replica: {latency: {kind: constant, iteration_s: 1}}\nhorizon_s: 10\n")
    scenario = load_scenario(path)
    assert scenario.workload.rate_scale == 2.0 and scenario.horizon_s == 10.0
    assert scenario.replica.latency.iteration_s == 1.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a\\b", "a//b", "a/", "a b",
                                  ".hidden", "a/../b", "a/./b", "", "x" * 201, "na:me",
                                  "テ" * 86])  # 258 bytes: over a directory name's 255
def test_names_that_are_not_safe_directories_are_refused(tmp_path, monkeypatch, capsys, name):
    code, err, path = simulate(tmp_path, monkeypatch, capsys, f"name: {name!r}\n" + synthetic(""))
    assert_one_line_error(code, err, str(path), "name=", "directory")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["study", "cmp/variant", "run_1.2-a+b=c", "a/b/c", "テスト",
                                  "ünïcödé/試験-1"])
def test_safe_names_are_kept(name):
    data = {"name": name, "workload": {"format": "vidur", "path": "t.csv"}}
    assert parse_scenario(data, "test").name == name


IMPOSSIBLE = {
    "chunk above budget": (
        "replica: {scheduler: {name: chunked_prefill, token_budget: 256, chunk_size: 512}}",
        ["replica.scheduler.chunk_size=512", "token_budget (256)"]),
    "window ends before it starts": (
        "workload: {format: vidur, path: trace.csv, start_s: 10, end_s: 5}",
        ["workload.end_s=5.0", "after start_s"]),
    "memory settings beside num_blocks": (
        "replica: {kv_cache: {num_blocks: 100, gpu_memory_utilization: 0.5}}",
        ["replica.kv_cache.gpu_memory_utilization=0.5", "num_blocks"]),
    "link on a colocated cluster": (
        "cluster: {replicas: 2, link: {bandwidth_gb_s: 10}}",
        ["cluster.link=", "disaggregated"]),
    "overlap on a colocated cluster": (
        "cluster: {overlap_transfer: true}", ["cluster.overlap_transfer=True", "disaggregated"]),
    "decode router on a colocated cluster": (
        "cluster: {decode_router: {name: random}}", ["cluster.decode_router=", "disaggregated"]),
    "cv of poisson arrivals": ("arrivals: {qps: 5, cv: 3}", ["workload.arrivals.cv=3.0", "gamma"]),
    "parameter of another distribution": (
        "workload: {format: synthetic, num_requests: 5, arrivals: {qps: 5}, lengths: "
        "{prompt: {dist: fixed, value: 5, mean: 9}, output: {dist: fixed, value: 2}}}",
        ["workload.lengths.prompt.mean=9", "not a parameter of fixed"]),
    "fixed value clipped away": (
        "workload: {format: synthetic, num_requests: 5, arrivals: {qps: 5}, lengths: "
        "{prompt: {dist: fixed, value: 500, max: 100}, output: {dist: fixed, value: 2}}}",
        ["workload.lengths.prompt.value=500", "outside [min, max]"]),
    "min above max": (
        "workload: {format: synthetic, num_requests: 5, arrivals: {qps: 5}, lengths: "
        "{prompt: {dist: lognormal, mean: 50, std: 5, min: 90, max: 10}, "
        "output: {dist: fixed, value: 2}}}", ["workload.lengths.prompt.min=90", "above max"]),
    # Was taken, every prompt then exactly 1000 tokens (as a fixed value outside [min, max] is
    # refused).
    "lognormal clipped whole to min": (
        "workload: {format: synthetic, num_requests: 5, arrivals: {qps: 5}, lengths: "
        "{prompt: {dist: lognormal, mean: 10, std: 1, min: 1000}, "
        "output: {dist: fixed, value: 2}}}",
        ["workload.lengths.prompt.min=1000", "clips 100.000% of lognormal draws (mean 10, std 1)"
         " to [min, max] = [1000, 1000000000]"]),
    "lognormal with min equal to max": (
        "workload: {format: synthetic, num_requests: 5, arrivals: {qps: 5}, lengths: "
        "{prompt: {dist: fixed, value: 5}, "
        "output: {dist: lognormal, mean: 50, std: 5, min: 60, max: 60}}}",
        ["workload.lengths.output.min=60", "[min, max] = [60, 60]"]),
    "length file and distributions": (
        "workload: {format: synthetic, num_requests: 5, arrivals: {qps: 5}, lengths: "
        "{file: trace.csv, prompt: {dist: fixed, value: 5}}}",
        ["workload.lengths", "not both"]),
    "time unit of generated arrivals": (
        "workload: {format: csv, path: trace.csv, time_unit: ms, arrivals: {qps: 5}, columns: "
        "{prompt_tokens: num_prefill_tokens, output_tokens: num_decode_tokens}}",
        ["workload.time_unit='ms'", "generated arrivals"]),
    "unknown scheduler names the name": (
        "replica: {scheduler: {name: fancy}}", ["replica.scheduler.name='fancy'", "known:"]),
}


@pytest.mark.parametrize("case", IMPOSSIBLE)
def test_impossible_or_ignored_settings_are_refused(tmp_path, monkeypatch, capsys, case):
    extra, needles = IMPOSSIBLE[case]
    text = extra + "\n" if extra.startswith("workload") else synthetic(extra)
    code, err, path = simulate(tmp_path, monkeypatch, capsys, text)
    assert_one_line_error(code, err, str(path), *needles)


BAD_FILES = {
    "directory": (None, ["is a directory"]),
    "empty": ("", ["empty"]),
    "only a comment": ("# nothing here\n", ["empty"]),
    "a list": ("- 1\n- 2\n", ["<top level>", "mapping"]),
    "a scalar": ("just text\n", ["<top level>", "mapping"]),
    "recursive alias": ("a: &a [*a]\n", ["<yaml>", "aliases"]),
    "not utf-8": (b"name: \xff\xfe\n", ["UTF-8"]),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_files_that_are_not_scenarios(tmp_path, monkeypatch, capsys, case):
    content, needles = BAD_FILES[case]
    path = tmp_path / "s.yaml"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, str(path), *needles)


def test_an_alias_bomb_is_refused_quickly(tmp_path, monkeypatch, capsys):
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):  # 9**10 strings once expanded: gigabytes
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with within(60):  # expanded, it would take minutes and gigabytes: refused unexpanded
        code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, str(path), "<yaml>", "aliases")


def test_paths_are_absolute_with_symlinks_kept(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    (real / "trace.csv").write_text(TRACE)
    scenario_path = tmp_path / "link" / "sub" / "s.yaml"
    scenario_path.parent.mkdir(parents=True)
    scenario_path.write_text("workload: {format: vidur, path: ../trace.csv}\n")
    scenario = load_scenario(scenario_path)
    path = scenario.workload.path  # type: ignore[attr-defined]
    assert path == tmp_path / "link" / "trace.csv"  # normalised, absolute, through the link
    assert path.is_absolute() and ".." not in path.parts


def test_pools_start_from_the_scenarios_replica():
    """A disaggregated cluster's pools inherit the top-level replica and change what they give;
    the top-level replica is never silently ignored."""
    scenario = parse_scenario({
        "workload": {"format": "synthetic", "num_requests": 5, "arrivals": {"qps": 1},
                     "lengths": {"prompt": {"dist": "fixed", "value": 10},
                                 "output": {"dist": "fixed", "value": 3}}},
        "replica": {"gpu": "h200", "scheduler": {"name": "chunked_prefill", "token_budget": 256},
                    "kv_cache": {"num_blocks": 500}},
        "cluster": {"prefill": {"replicas": 1, "replica": {"scheduler": {"token_budget": 1024}}},
                    "decode": {"replicas": 1,
                               "replica": {"gpu": "a100-80gb",
                                           "scheduler": {"name": "prefill_first"}}}},
    }, "test")
    prefill, decode = scenario.cluster.prefill.replica, scenario.cluster.decode.replica
    assert (prefill.gpu, prefill.scheduler.name, prefill.scheduler.token_budget) == (
        "h200", "chunked_prefill", 1024)
    assert prefill.kv_cache.num_blocks == decode.kv_cache.num_blocks == 500
    assert (decode.gpu, decode.scheduler.name) == ("a100-80gb", "prefill_first")
    # The resolved scenario reads back to the same one.
    import yaml

    from sim.config.scenario import scenario_yaml
    again = parse_scenario(yaml.safe_load(scenario_yaml(scenario)), "again")
    assert scenario_yaml(again) == scenario_yaml(scenario)


def test_kv_transfer_settings_on_a_colocated_cluster_are_shown_as_written(tmp_path):
    # They were shown as a Python repr: LinkConfig(bandwidth_gb_s=10.0, latency_s=5e-06).
    data = {"workload": {"format": "vidur", "path": trace(tmp_path, [(0.0, 16, 2)])},
            "cluster": {"link": {"bandwidth_gb_s": 10}, "decode_router": {"name": "round_robin"},
                        "overlap_transfer": True}}
    with pytest.raises(InputError) as exc:
        parse_scenario(data, "s.yaml")
    assert exc.value.lines() == [
        f"s.yaml: cluster.{field}={value}: only used by a disaggregated cluster (prefill and "
        "decode pools)" for field, value in [
            ("decode_router", "{name: round_robin}"),
            ("link", "{bandwidth_gb_s: 10.0, latency_s: 5.0e-06}"),
            ("overlap_transfer", "True")]]
    # Settings equal to the defaults, as a resolved scenario.yaml spells them out, still run.
    del data["cluster"]
    scenario = parse_scenario(data, "s.yaml")
    resolved = yaml.safe_load(scenario_yaml(scenario))
    assert resolved["cluster"]["link"] == {"bandwidth_gb_s": 50.0, "latency_s": 5e-06}
    assert parse_scenario(resolved, "s.yaml").cluster == scenario.cluster
