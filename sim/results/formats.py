"""What the result files of many runs are called and what their tables hold: written by
`sim.studies` (sweeps, replications), read by plots, reports and exports, which therefore need
none of the code that runs studies.
"""

from __future__ import annotations

# A sweep's tables of estimates with 95% intervals (several seeds a point).
CI_TABLES = ("results_ci.parquet", "results_ci.csv")

METRICS = {  # column -> path in summary.json
    "overload": ("overload", "verdict"),
    "finished": ("requests", "finished"), "rejected": ("requests", "rejected"),
    "unfinished": ("requests", "unfinished"),
    "ttft_p50_s": ("ttft_s", "p50"), "ttft_p90_s": ("ttft_s", "p90"),
    "ttft_p99_s": ("ttft_s", "p99"), "tbt_p50_s": ("tbt_s", "p50"),
    "tbt_p99_s": ("tbt_s", "p99"), "tpot_p50_s": ("tpot_s", "p50"),
    "e2e_p50_s": ("e2e_s", "p50"), "e2e_p99_s": ("e2e_s", "p99"),
    "sched_delay_p50_s": ("scheduling_delay_s", "p50"),
    "requests_per_s": ("throughput", "requests_per_s"),
    "output_tokens_per_s": ("throughput", "output_tokens_per_s"),
    "slo_attainment": ("slo", "all_attainment"),
    "num_gpus": ("cost", "num_gpus"),
    "requests_per_s_per_gpu": ("cost", "requests_per_s_per_gpu"),
    "usd_per_million_tokens": ("cost", "usd_per_million_tokens"),
    # Last: earlier columns keep their places. Requests whose client gave up (a timeout).
    "failed": ("requests", "failed"),
}

# Replications of a run, and of a comparison.
REPLICATIONS_FILE = "replications.json"
REPLICATED_COMPARISON_FILE = "comparison_replications.csv"
# What a replications file holds estimates of.
DISTRIBUTIONS = ("ttft_s", "tbt_s", "e2e_s")
PERCENTILES = ("p50", "p90", "p99")
THROUGHPUT = ("requests_per_s", "output_tokens_per_s")
