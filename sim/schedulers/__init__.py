"""Scheduling policies. Importing this package registers every built-in scheduler."""

from sim.schedulers import (  # noqa: F401  (registration)
    chunked_prefill,
    prefill_first,
    sglang,
    vllm_engine,
    vllm_v1,
)
from sim.schedulers.base import SCHEDULERS, Scheduler, SchedulerConfig

__all__ = ["SCHEDULERS", "Scheduler", "SchedulerConfig"]
