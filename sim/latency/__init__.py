"""Latency models. Importing this package registers every built-in kind."""

from sim.latency import constant, linear, profile, recorded, roofline  # noqa: F401  (registration)
from sim.latency.base import LATENCY_MODELS, BatchShape, LatencyModel

__all__ = ["LATENCY_MODELS", "BatchShape", "LatencyModel"]
