"""Workload formats. Importing this package registers every built-in format."""

from sim.workloads import azure, generic, lengths, mooncake, prefix, synthetic, vidur  # noqa: F401
from sim.workloads.base import FORMATS, Workload, WorkloadConfig, select

__all__ = ["FORMATS", "Workload", "WorkloadConfig", "select"]
