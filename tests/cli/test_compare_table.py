"""The comparison table printed by `servesim compare`, read in an 80-column terminal."""

from __future__ import annotations

import pandas as pd
import pytest
from rich.console import Console

from sim.cli.compare import comparison_tables


def rows(names: list[str], **changes) -> pd.DataFrame:
    base = {"pools": "2x", "parallelism": "TP1", "scheduler": "chunked_prefill",
            "overload": "stable", "finished": 19366, "ttft_p50_s": 0.04, "ttft_p99_s": 0.2,
            "tbt_p50_s": 0.008, "tbt_p99_s": 0.016, "e2e_p99_s": 5.5,
            "output_tokens_per_s": 4654.0, "slo_attainment": 1.0, "transfer_p99_s": None,
            "num_gpus": 4, "usd_per_million_tokens": 0.25}
    return pd.DataFrame([{"variant": n, **base, **changes} for n in names])


def shown(tables) -> str:
    console = Console(width=80, record=True)
    for table in tables:
        console.print(table)
    return console.export_text()


def test_names_stay_whole_and_lines_fit_80_columns():
    names = [f"variant_number_{k:03d}" for k in range(6)]  # 18 characters each
    text = shown(comparison_tables("cmp", rows(names), 80))
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in names:
        assert name in text  # not folded over two lines
    assert "cmp (1 of 2)" in text and "cmp (2 of 2)" in text
    assert "19,366" in text


def test_rows_no_variant_has_are_left_out_and_same_pools_named_once():
    text = shown(comparison_tables("cmp", rows(["a", "b"], scheduler="sglang/sglang",
                                               parallelism="TP4/TP4"), 80))
    assert "KV transfer" not in text
    assert "sglang/sglang" not in text and "sglang" in text
    assert "2x TP4" in text and "TP4/TP4" not in text


def test_a_disaggregated_variant_says_its_attainment_counts_the_hand_off():
    plain = shown(comparison_tables("cmp", rows(["a", "b"]), 80))
    assert "hand-off" not in plain
    df = rows(["colocated", "pd"])
    df.loc[1, "transfer_p99_s"] = 0.006
    text = shown(comparison_tables("cmp", df, 80))
    assert "KV transfer" in text
    assert "TBT gaps include its KV hand-off" in " ".join(text.split())


def test_a_host_tier_s_hits_and_loads_are_in_the_comparison(tmp_path):
    """The comparison of CPU tiers (as `scenarios/compare_kv_offload.yaml`, shortened): the
    table and `comparison.csv` carry each variant's prompt tokens cached (any tier), those
    loaded from the host and a load's mean time, read from its `summary.json`; a variant
    without a tier has none loaded."""
    from sim.config.scenario import parse_scenario
    from sim.studies.compare import compare

    base = {"seed": 0,
            "workload": {"format": "shared_prefix", "num_groups": 24,
                         "num_prompts_per_group": 4, "system_prompt_tokens": 2000,
                         "question_tokens": 200, "output_tokens": 20, "rate_qps": 3.0,
                         "duration_s": 30},
            "replica": {"model": "llama-3.1-8b", "gpu": "rtx4090",
                        "scheduler": {"name": "vllm_v1", "engine_version": "0.15.1"},
                        "prefix_caching": True, "kv_cache": {"num_blocks": 1000}}}
    scenarios = {name: parse_scenario(
        {**base, "name": f"cmp/{name}",
         "replica": {**base["replica"], **({"kv_offload": {"size_gib": 32}} if tier else {})}},
        "<test>") for name, tier in (("no_tier", False), ("cpu_32gib", True))}
    table, results = compare(scenarios, tmp_path / "cmp")
    saved = pd.read_csv(tmp_path / "cmp" / "comparison.csv").set_index("variant")
    for variant, res in results.items():
        offload = res.summary.get("kv_offload") or {}
        assert saved.loc[variant, "prefix_hit_rate"] == pytest.approx(
            res.summary["prefix_cache"]["hit_rate_tokens"])
        if variant == "no_tier":
            assert pd.isna(saved.loc[variant, "cpu_hit_rate"])
        else:
            assert saved.loc[variant, "cpu_hit_rate"] == pytest.approx(
                offload["hit_rate_tokens"]["cpu"])
            assert saved.loc[variant, "mean_load_s"] == pytest.approx(offload["mean_load_s"])
    # The tier brings back prefixes the GPU's 1,000 blocks evicted.
    assert saved.loc["cpu_32gib", "cpu_hit_rate"] > 0.2
    assert saved.loc["cpu_32gib", "prefix_hit_rate"] > saved.loc["no_tier", "prefix_hit_rate"]
    text = shown(comparison_tables("cmp", table, 80))
    hits = next(line for line in text.splitlines() if line.startswith("host-tier hits %"))
    assert hits.split()[-2] == "-"  # (no tier: nothing loaded)
    assert "prefix hits %" in text and "host-tier load ms" in text
    assert max(len(line) for line in text.splitlines()) <= 80
