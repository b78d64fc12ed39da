"""Routers. Importing this package registers every built-in router."""

from sim.routers import (  # noqa: F401  (registration)
    least_kv_load,
    least_outstanding,
    prefix_affinity,
    random,
    round_robin,
    vllm_dp,
)
from sim.routers.base import ROUTERS, ReplicaLoad, Router, RouterConfig

__all__ = ["ROUTERS", "ReplicaLoad", "Router", "RouterConfig"]
