"""Scheduling policies. Importing this package registers every built-in scheduler."""

from sim.schedulers import chunked_prefill, prefill_first, sglang, vllm_v1  # noqa: F401  (registration)
from sim.schedulers.base import SCHEDULERS, Scheduler, SchedulerConfig

__all__ = ["SCHEDULERS", "Scheduler", "SchedulerConfig"]
