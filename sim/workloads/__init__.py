"""Workload formats. Importing this package registers every built-in format."""

from sim.workloads import (  # noqa: F401  (each registers its format)
    azure,
    burstgpt,
    generic,
    lengths,
    mooncake,
    prefix,
    shared_prefix,
    synthetic,
    vidur,
    vllm_bench,
)
from sim.workloads.base import FORMATS, Workload, WorkloadConfig, select

__all__ = ["FORMATS", "Workload", "WorkloadConfig", "select"]
