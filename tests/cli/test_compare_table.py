"""The comparison table printed by `servesim compare`, read in an 80-column terminal."""

from __future__ import annotations

import pandas as pd
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
