"""Routers. Importing this package registers every built-in router."""

from sim.routers import least_kv_load, least_outstanding, random, round_robin  # noqa: F401
from sim.routers.base import ROUTERS, ReplicaLoad, Router, RouterConfig

__all__ = ["ROUTERS", "ReplicaLoad", "Router", "RouterConfig"]
