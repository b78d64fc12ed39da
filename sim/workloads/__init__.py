"""Workload formats.

Each built-in one is a module here with a registry decorator, imported when it is first named
(`sim.core.registry`)."""

from sim.workloads.base import FORMATS, Workload, WorkloadConfig, select

__all__ = ["FORMATS", "Workload", "WorkloadConfig", "select"]
