"""Request classes (`workload.classes`): drawn by share from their own stream (no other draw
changes), a session's turns in one class, every class's metrics in the summary, the table
and the report; bad classes and priorities without a priority policy are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from sim.config.scenario import parse_scenario
from sim.runner import run_scenario
from sim.workloads.load import load_workload
from tests.helpers import assert_one_line_error, run_cli, run_cli_out

CLASSES = [{"name": "interactive", "share": 0.3, "priority": 0,
            "slo": {"ttft_s": 0.25, "tbt_s": 0.05}},
           {"name": "batch", "share": 0.7, "priority": 2}]


def scenario(num_requests=400, qps=20.0, policy="priority", classes=CLASSES, **workload):
    return {"name": "classes", "seed": 3,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": qps},
                         "lengths": {"prompt": {"dist": "uniform", "low": 100, "high": 2000},
                                     "output": {"dist": "uniform", "low": 20, "high": 300}},
                         **({"classes": classes} if classes is not None else {}), **workload},
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                        "scheduler": {"name": "vllm_v1", "scheduling_policy": policy,
                                      "max_num_seqs": 16}},
            "slo": {"ttft_s": 2.0}}


def test_classes_are_drawn_by_share_and_change_no_other_draw():
    with_classes = load_workload(parse_scenario(scenario(20_000), "t"))
    without = load_workload(parse_scenario(scenario(20_000, classes=None), "t"))
    assert with_classes.request_class is not None and without.request_class is None
    for column in ("arrival_s", "num_prompt_tokens", "num_output_tokens"):
        np.testing.assert_array_equal(getattr(with_classes, column), getattr(without, column))
    share = np.bincount(with_classes.request_class, minlength=2) / 20_000
    assert share == pytest.approx([0.3, 0.7], abs=0.015)
    again = load_workload(parse_scenario(scenario(20_000), "t"))
    np.testing.assert_array_equal(again.request_class, with_classes.request_class)
    other_seed = load_workload(parse_scenario({**scenario(20_000), "seed": 4}, "t"))
    assert (other_seed.request_class != with_classes.request_class).any()


def test_the_turns_of_a_session_share_its_class():
    data = scenario(classes=CLASSES)
    data["workload"] = {"format": "prefix", "num_conversations": 300, "num_turns": 4,
                        "arrivals": {"process": "poisson", "qps": 5.0},
                        "question_tokens": {"dist": "uniform", "low": 10, "high": 200},
                        "output_tokens": {"dist": "uniform", "low": 10, "high": 100},
                        "hash_block_tokens": 16, "classes": CLASSES}
    workload = load_workload(parse_scenario(data, "t"))
    assert workload.sessions is not None and workload.request_class is not None
    for session in np.unique(workload.sessions.session):
        assert len(set(workload.request_class[workload.sessions.session == session])) == 1
    assert len(set(workload.request_class.tolist())) == 2


def test_every_class_is_reported_and_priority_serves_the_interactive_first(tmp_path):
    # Near capacity (16 running at most, about 10 req/s): the batch class queues, the
    # interactive one hardly.
    fast = run_scenario(parse_scenario(scenario(qps=10.0), "t"), out_dir=tmp_path / "p")
    fcfs_classes = [{**c, "priority": 0} for c in CLASSES]
    fcfs = run_scenario(parse_scenario(scenario(qps=10.0, policy="fcfs",
                                                classes=fcfs_classes), "t"))
    req = fast.requests
    assert set(req["request_class"]) == {"interactive", "batch"}
    assert (req.loc[req["request_class"] == "batch", "priority"] == 2).all()
    by_name = {c["name"]: c for c in fast.summary["classes"]}
    assert [c["name"] for c in fast.summary["classes"]] == ["interactive", "batch"]
    assert sum(c["requests"]["total"] for c in by_name.values()) == len(req)
    for name, c in by_name.items():
        mine = req[req["request_class"] == name]
        assert c["ttft_s"]["p50"] == pytest.approx(mine["ttft_s"].median())
        assert c["requests"]["finished"] == int((mine["status"] == "finished").sum())
    # The class's own targets, else the run's.
    assert by_name["interactive"]["slo"]["targets"] == {"ttft_s": 0.25, "tbt_s": 0.05}
    assert by_name["batch"]["slo"]["targets"] == {"ttft_s": 2.0}
    inter = req[req["request_class"] == "interactive"]
    met = ((inter["status"] == "finished") & (inter["ttft_s"] <= 0.25)
           & ~(inter["max_tbt_s"] > 0.05)).mean()
    assert by_name["interactive"]["slo"]["all_attainment"] == pytest.approx(met)
    # Priority: the interactive class waits far less than under FCFS, the batch one more.
    first = {c["name"]: c["ttft_s"]["p90"] for c in fcfs.summary["classes"]}
    assert by_name["interactive"]["ttft_s"]["p90"] < 0.5 * first["interactive"]
    assert by_name["batch"]["ttft_s"]["p90"] > first["batch"]
    written = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert [c["name"] for c in written["classes"]] == ["interactive", "batch"]


def test_the_table_and_the_report_show_the_classes(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario(qps=10.0)))
    monkeypatch.setenv("COLUMNS", "80")
    code, out = run_cli_out(monkeypatch, capsys, "simulate", str(path), "--out",
                            str(tmp_path / "r"))
    assert code == 0
    assert "request classes" in out and "interactive" in out and "batch" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    code, _ = run_cli_out(monkeypatch, capsys, "report", str(tmp_path / "r"))
    html = (tmp_path / "r" / "report.html").read_text()
    assert code == 0 and "By request class" in html and "SLO met (%)" in html


@pytest.mark.parametrize("change,field,needle", [
    ({"classes": [{**CLASSES[0], "share": 0.2}, CLASSES[1]]}, "workload.classes",
     "shares sum to 0.9"),
    ({"classes": [CLASSES[0], {**CLASSES[1], "name": "interactive"}]}, "workload.classes",
     "class names must differ"),
    ({"classes": [{**CLASSES[0], "name": "a b"}, CLASSES[1]]}, "workload.classes.0.name",
     "should match pattern"),
])
def test_bad_classes_are_one_line(tmp_path, monkeypatch, capsys, change, field, needle):
    data = scenario(policy=change.pop("policy", "priority"))
    data["workload"].update(change)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, field, needle)


@pytest.mark.parametrize("scheduler", [{"name": "sglang"},
                                       {"name": "vllm_v1", "scheduling_policy": "fcfs"}])
def test_priorities_under_fcfs_are_ignored_and_said_so(tmp_path, monkeypatch, capsys,
                                                       scheduler):
    # As vLLM's FCFS: a request's priority accepted, the queue in arrival order.
    data = scenario(qps=10.0)
    data["replica"]["scheduler"] = {**scheduler, "max_num_seqs": 16}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("COLUMNS", "200")
    code, out = run_cli_out(monkeypatch, capsys, "simulate", str(path), "--out",
                            str(tmp_path / "o"))
    assert code == 0 and "priorities ignored" in out and "[0, 2]" in out
    flat = dict(data, workload={**data["workload"], "classes": [
        {**c, "priority": 0} for c in CLASSES]})
    ignored = run_scenario(parse_scenario(data, "t"))
    same = run_scenario(parse_scenario(flat, "t"))
    assert ignored.requests.drop(columns="priority").equals(
        same.requests.drop(columns="priority"))
    assert "priorities_ignored" not in same.summary["run"]


def test_sglang_priority_pools_are_not_said_to_ignore_priorities():
    """SGLang with `enable_priority_scheduling` orders by the priorities (colocated, or a
    disaggregated pool): only a pool that serves in arrival order is named."""
    from sim.results.metrics.classes import priorities_ignored

    sglang = {"name": "sglang", "enable_priority_scheduling": True}
    data = scenario()
    data["replica"]["scheduler"] = sglang
    assert priorities_ignored(parse_scenario(data, "t")) is None
    data["cluster"] = {"prefill": {"replicas": 1, "replica": {"scheduler": sglang}},
                       "decode": {"replicas": 1, "replica": {"scheduler": {
                           "name": "sglang", "enable_priority_scheduling": False}}}}
    note = priorities_ignored(parse_scenario(data, "t"))
    assert note is not None and "cluster.decode.replica.scheduler (sglang)" in note
    assert "cluster.prefill" not in note


def tagged_trace(tmp_path, names):
    rows = ["t,prompt,output,kind"] + [f"{0.05 * i:.2f},{200 + 10 * i},{20 + i},{n}"
                                       for i, n in enumerate(names)]
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(rows) + "\n")
    return {"format": "csv", "path": str(path),
            "columns": {"arrival": "t", "prompt_tokens": "prompt", "output_tokens": "output",
                        "request_class": "kind"},
            "classes": [{"name": "chat", "priority": 0, "slo": {"ttft_s": 0.5}},
                        {"name": "batch", "priority": 1}]}


def test_a_trace_tags_each_requests_class(tmp_path):
    names = ["chat", "batch", "batch", "chat", "batch"] * 8
    data = scenario()
    data["workload"] = tagged_trace(tmp_path, names)
    res = run_scenario(parse_scenario(data, "t"))
    assert res.requests.sort_values("request_id")["request_class"].tolist() == names
    counts = {c["name"]: c["requests"]["total"] for c in res.summary["classes"]}
    assert counts == {"chat": 16, "batch": 24}


@pytest.mark.parametrize("change,field,needle", [
    ("unknown", "kind", "not a class of workload.classes (chat, batch)"),
    ("shares", "workload.classes", "leave the shares out"),
    ("no classes", "workload.columns.request_class", "list them"),
])
def test_bad_tagged_classes_are_one_line(tmp_path, monkeypatch, capsys, change, field, needle):
    data = scenario()
    data["workload"] = tagged_trace(tmp_path, ["chat", "batch", "urgent" if change == "unknown"
                                               else "chat"])
    if change == "shares":
        data["workload"]["classes"][0]["share"] = 0.5
    if change == "no classes":
        del data["workload"]["classes"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, field, needle)


def test_the_decode_pool_admits_transfers_by_priority():
    # Two prefill replicas feed one decode replica short of KV: transfers queue for its blocks
    # and the interactive class (priority 0) goes first.
    data = scenario(num_requests=600, qps=25.0)
    pool = {"model": "llama-3.1-8b", "gpu": "h100-sxm",
            "scheduler": {"name": "vllm_v1", "scheduling_policy": "priority", "max_num_seqs": 64}}
    data["cluster"] = {"prefill": {"replicas": 2, "replica": pool},
                       "decode": {"replicas": 1, "replica": {**pool, "kv_cache": {
                           "num_blocks": 1500}}}}
    del data["replica"]
    req = run_scenario(parse_scenario(data, "t")).requests
    wait = req.groupby("request_class")["decode_wait_s"].mean()
    assert wait["interactive"] < 0.5 * wait["batch"]


def test_replications_vary_the_classes_of_a_trace(traces):
    from sim.studies.replications import variation_sources

    data = scenario()
    data["workload"] = {"format": "azure", "end_s": 60, "classes": CLASSES, "path": str(
        traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")}
    assert variation_sources(parse_scenario(data, "t")) == ["request classes drawn by share"]


def test_a_class_one_variant_lacks_is_a_dash_in_the_comparison():
    import pandas as pd

    from sim.cli.compare import comparison_table

    df = pd.DataFrame({"variant": ["a", "b"], "finished": [10, 10],
                       "class:interactive:ttft_p99_s": [0.5, float("nan")],
                       "class:interactive:slo_attainment": [0.9, float("nan")]})
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(comparison_table("t", df))
    text = console.export_text()
    assert "nan" not in text and "interactive: SLO" in text and "90.0%" in text


def test_a_comparisons_report_heads_class_columns_in_their_units():
    from sim.report.markup import header, scale

    assert header("class:interactive:ttft_p99_s") == f"interactive: {header('ttft_p99_s')}"
    assert scale("class:interactive:ttft_p99_s") == scale("ttft_p99_s") == 1000
    assert scale("class:batch:slo_attainment") == scale("slo_attainment") == 100
