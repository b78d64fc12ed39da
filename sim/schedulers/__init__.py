"""Scheduling policies.

Each built-in one is a module here with a registry decorator, imported when it is first named
(`sim.core.registry`)."""

from sim.schedulers.base import SCHEDULERS, Scheduler, SchedulerConfig

__all__ = ["SCHEDULERS", "Scheduler", "SchedulerConfig"]
