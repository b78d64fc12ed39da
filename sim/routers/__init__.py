"""Routers.

Each built-in one is a module here with a registry decorator, imported when it is first named
(`sim.core.registry`)."""

from sim.routers.base import ROUTERS, ReplicaLoad, Router, RouterConfig

__all__ = ["ROUTERS", "ReplicaLoad", "Router", "RouterConfig"]
