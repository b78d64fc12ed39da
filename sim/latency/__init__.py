"""Latency models.

Each built-in one is a module here with a registry decorator, imported when it is first named
(`sim.core.registry`)."""

from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyModel

__all__ = ["LATENCY_MODELS", "BatchShape", "LatencyModel"]
