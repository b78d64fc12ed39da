"""The `prefix` workload format: shared system prompts and multi-turn conversations, with the
prefix-block ids a prefix cache reads."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.workloads import Workload
from sim.workloads.load import load_workload
from tests.helpers import assert_one_line_error, run_cli, run_cli_out, within

BASE = {"format": "prefix", "arrivals": {"qps": 4}}


def workload(seed: int = 0, **fields: Any) -> Workload:
    spec = {**BASE, **fields}
    return load_workload(parse_scenario({"seed": seed, "workload": spec}, "test"))


def rows(w: Workload) -> list[tuple[float, int, int, tuple[int, ...]]]:
    assert w.hash_ids is not None
    return list(zip(w.arrival_s.tolist(), w.num_prompt_tokens.tolist(),
                    w.num_output_tokens.tolist(), w.hash_ids, strict=True))


def hit_share(w: Workload) -> float:
    """Of all prompt tokens, the share in leading full blocks that an earlier request held:
    what a prefix cache that never evicts could skip."""
    seen: set[int] = set()
    hits = 0
    for _, prompt, _, ids in rows(w):
        run = 0
        for key in ids[:prompt // w.hash_block_tokens]:
            if key not in seen:
                break
            run += 1
        hits += run * w.hash_block_tokens
        seen.update(ids)
    return hits / int(w.num_prompt_tokens.sum())


def conversations(w: Workload, key_block: int) -> list[list[tuple]]:
    """Requests grouped by conversation, in arrival order, keyed by the id of a block every
    turn of a conversation holds whole and no other conversation has."""
    by_key = defaultdict(list)
    for row in rows(w):
        by_key[row[3][key_block]].append(row)
    return list(by_key.values())


@pytest.mark.parametrize("system", [100, 128])  # 100: block 1 straddles the prompt's end
def test_system_prompt_blocks_are_shared_by_their_group_alone(system):
    w = workload(num_conversations=40, num_groups=4, system_prompt_tokens=system,
                 question_tokens=30, output_tokens=10)
    assert len(w) == 40 and w.hash_block_tokens == 64
    assert set(w.num_prompt_tokens.tolist()) == {system + 30}
    assert set(w.num_output_tokens.tolist()) == {10}
    full = system // 64
    groups: dict[tuple[int, ...], int] = defaultdict(int)
    for _, prompt, output, ids in rows(w):
        assert len(ids) == -(-(prompt + output) // 64)  # they cover prompt and answer
        groups[ids[:full]] += 1
    assert sorted(groups.values()) == [10, 10, 10, 10]  # balanced, as both benchmarks
    assert len({key for ids in groups for key in ids}) == 4 * full  # groups share no block
    # Past the system prompt's full blocks every id is unique, the straddling block's too
    # (it holds the end of the system prompt and the start of a question).
    rest = [key for *_, ids in rows(w) for key in ids[full:]]
    assert len(rest) == len(set(rest)) == 40 * (-(-(system + 40) // 64) - full)


def test_conversations_outside_the_shared_fraction_have_a_system_prompt_of_their_own():
    w = workload(num_conversations=40, num_groups=2, system_prompt_tokens=128,
                 shared_fraction=0.25, question_tokens={"dist": "uniform", "low": 1, "high": 50},
                 output_tokens=5)
    first = [ids[:2] for *_, ids in rows(w)]
    shared = [ids for ids in first if first.count(ids) > 1]
    assert len(shared) == 10 and len(set(shared)) == 2  # round(0.25 * 40), dealt to 2 groups
    assert (w.num_prompt_tokens > 128).all()  # the others' system prompts are as long


def test_each_turn_starts_with_every_full_block_of_the_previous_turn():
    block, system = 64, 100
    w = workload(num_conversations=60, num_groups=3, system_prompt_tokens=system,
                 num_turns={"dist": "uniform", "low": 1, "high": 5}, think_time_s=30.0,
                 question_tokens={"dist": "uniform", "low": block, "high": 200},
                 output_tokens={"dist": "uniform", "low": 1, "high": 100})
    assert np.all(np.diff(w.arrival_s) >= 0) and w.arrival_s[0] == 0.0
    convs = conversations(w, key_block=system // block)  # questions fill the straddling block
    assert len(convs) == 60 and len(w) == sum(len(c) for c in convs)
    assert {len(c) for c in convs} == {1, 2, 3, 4, 5}
    for conv in convs:
        assert len({ids[0] for *_, ids in conv}) == 1  # one system prompt per conversation
        for (_, prompt0, output0, ids0), (_, prompt, output, ids) in itertools.pairwise(conv):
            history = prompt0 + output0
            assert block <= prompt - history <= 200  # the history, then a new question
            assert len(ids) == -(-(prompt + output) // block)
            assert ids[:history // block] == ids0[:history // block]
            if history % block:  # the previous turn's last block was partial: not shared
                assert ids0[-1] not in ids


def test_turns_arrive_a_think_time_after_the_previous_turn():
    w = workload(num_conversations=20, num_turns=3, think_time="fixed", think_time_s=2.5,
                 question_tokens=64, output_tokens=64, hash_block_tokens=16)
    for conv in conversations(w, key_block=0):
        arrivals = [row[0] for row in conv]
        assert np.diff(arrivals) == pytest.approx([2.5, 2.5])
        assert [row[1] for row in conv] == [64, 192, 320]


def test_the_same_seed_gives_the_same_workload():
    spec: dict[str, Any] = {"num_conversations": 50, "num_groups": 4, "system_prompt_tokens": 300,
            "shared_fraction": 0.5, "num_turns": {"dist": "uniform", "low": 1, "high": 4},
            "question_tokens": {"dist": "lognormal", "mean": 100, "std": 80},
            "output_tokens": {"dist": "uniform", "low": 1, "high": 64}}
    first, again, other = workload(**spec), workload(**spec), workload(seed=1, **spec)
    assert rows(first) == rows(again)
    assert rows(first) != rows(other)
    for w in (first, other):
        assert w.arrival_s.dtype == np.float64 and w.num_prompt_tokens.dtype == np.int64
        assert w.num_output_tokens.dtype == np.int64 and w.num_output_tokens.min() >= 1


def test_hit_share_of_shared_system_prompts():
    n, groups, fraction, system = 200, 8, 0.5, 1000
    w = workload(num_conversations=n, num_groups=groups, system_prompt_tokens=system,
                 shared_fraction=fraction,
                 question_tokens={"dist": "lognormal", "mean": 300, "std": 200},
                 output_tokens=50)
    # Every shared conversation but the first of each group reuses the full blocks of its
    # system prompt (960 of its 1000 tokens); the rest hit nothing.
    expected = (n * fraction - groups) * (system // 64 * 64) / w.num_prompt_tokens.sum()
    assert hit_share(w) == pytest.approx(expected)


def test_hit_share_of_multi_turn_conversations():
    # Turn k: prompt 64k - 24 tokens (k questions of 40, k-1 answers of 24); it reuses the
    # k-1 earlier turns' 64 (k - 1) tokens, all in full 16-token blocks.
    w = workload(num_conversations=30, num_turns=4, think_time_s=5.0, question_tokens=40,
                 output_tokens=24, hash_block_tokens=16)
    turns = np.arange(1, 5)
    assert hit_share(w) == pytest.approx((64 * (turns - 1)).sum() / (64 * turns - 24).sum())


def test_a_first_turn_may_have_a_message_of_its_own():
    # Turn 0: system 128 + task 1000; turn k: + k * (answer 24 + follow-up 40).
    w = workload(num_conversations=5, num_turns=3, system_prompt_tokens=128,
                 first_question_tokens=1000, question_tokens=40, output_tokens=24,
                 think_time_s=5.0, think_time="fixed", hash_block_tokens=16)
    for conversation in conversations(w, key_block=8):
        assert [prompt for _, prompt, _, _ in conversation] == [1128, 1192, 1256]


def test_agentic_sessions_have_the_published_shape():
    """scenarios/compare_agentic_sessions.yaml against the vLLM blog's Codex / SWE-bench Pro
    figures (2026-05-06): 33 turns (the median), about 80K tokens of context by turn 30,
    input:output 131:1, a 94.2% cache hit rate (ours: 95.2% by construction, see the file)."""
    path = Path(__file__).parents[2] / "scenarios" / "compare_agentic_sessions.yaml"
    base = yaml.safe_load(path.read_text())["base"]
    w = load_workload(parse_scenario(base, path, path.parent))
    assert w.sessions is not None
    assert (np.bincount(w.sessions.session) == 33).all()
    turn = w.sessions.turn
    assert w.num_prompt_tokens[turn == 30].mean() == pytest.approx(80_000, rel=0.05)
    ratio = w.num_prompt_tokens.mean() / w.num_output_tokens.mean()
    assert ratio == pytest.approx(131, rel=0.07)
    assert hit_share(w) == pytest.approx(0.942, abs=0.02)


def test_runs_as_a_scenario():
    data = {"seed": 3,
            "workload": {**BASE, "num_conversations": 12, "num_turns": 2, "num_groups": 2,
                         "system_prompt_tokens": 256, "question_tokens": 40,
                         "output_tokens": {"dist": "uniform", "low": 1, "high": 20}},
            "replica": {"latency": {"kind": "constant", "iteration_s": 0.01}}}
    res = run_scenario(parse_scenario(data, "test"))
    req = res.requests
    assert len(req) == 24 and (req["status"] == "finished").all()
    assert sorted(req["num_prompt_tokens"].unique().tolist())[0] == 296


GOOD = {"num_conversations": 10, "arrivals": {"qps": 2}, "num_groups": 2,
        "system_prompt_tokens": 512, "question_tokens": {"dist": "uniform", "low": 16, "high": 128},
        "output_tokens": 8, "num_turns": 2, "think_time_s": 3.0}


def scenario_file(tmp_path: Path, **changes) -> Path:
    """A YAML scenario of GOOD's workload with `changes`."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "prefix", "workload": {"format": "prefix", **GOOD, **changes},
        "replica": {"latency": {"kind": "constant", "iteration_s": 0.01}}}))
    return path


def test_simulate_cli(tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    code, _ = run_cli_out(monkeypatch, capsys, "simulate", str(scenario_file(tmp_path)),
                          "--out", str(out))
    assert code == 0
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 20 and (req["status"] == "finished").all()
    assert req["arrival_s"].is_monotonic_increasing


@pytest.mark.parametrize("changes,needles", [
    ({"shared_fraction": 1.5}, ["workload.shared_fraction=1.5", "less than or equal to 1"]),
    ({"hash_block_tokens": 0}, ["workload.hash_block_tokens=0"]),
    ({"hash_block_tokens": 1024}, ["workload.system_prompt_tokens=512", "one hash block"]),
    ({"think_time": "gamma"}, ["workload.think_time='gamma'"]),
    ({"frequency": 3}, ["workload.frequency", "Extra inputs"]),
    ({"num_turns": 0}, ["workload.num_turns.value=0"]),
    ({"question_tokens": True}, ["workload.question_tokens=True", "mapping"]),
    # Would do nothing:
    ({"num_turns": 1}, ["workload.think_time_s=3.0", "no effect with one turn"]),
    ({"system_prompt_tokens": 0}, ["workload.num_groups=2", "without system_prompt_tokens"]),
    ({"shared_fraction": 0.0}, ["workload.num_groups=2", "shared_fraction is 0"]),
    # Too much to simulate:
    ({"num_turns": {"dist": "fixed", "value": 2_000_000}},
     ["workload.num_turns=2000000", "20000000 requests"]),
    ({"think_time_s": 1e300}, ["workload.think_time_s=1e+300", "2**32"]),
    ({"system_prompt_tokens": 10**9}, ["workload.system_prompt_tokens=1000000000",
                                       "a prompt of 10000000", "(at most 1000000000)"]),
    ({"num_turns": 3, "question_tokens": 600_000_000}, ["workload.num_turns=3",
                                                         "(at most 1000000000)"]),
    ({"first_question_tokens": 10**9}, ["workload.first_question_tokens=",
                                        "(at most 1000000000)"]),
    ({"num_conversations": 200_000, "question_tokens": 1000, "hash_block_tokens": 1},
     ["workload.hash_block_tokens=1", "prefix-block ids"]),
])
def test_bad_fields_are_one_line_errors(tmp_path, monkeypatch, capsys, changes, needles):
    path = scenario_file(tmp_path, **changes)
    with within(60):  # refused before generating much (a hang guard, not a timing)
        code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                            str(tmp_path / "o"))
    assert_one_line_error(code, err, str(path), *needles)
