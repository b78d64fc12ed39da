"""The router interface: which replica of a pool gets a request. A pure policy, like a scheduler:
it sees each replica's load as numbers, never SimPy or the clock."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from pydantic import BaseModel

from sim.config.errors import INPUT_MODEL
from sim.core.registry import Registry
from sim.core.request import Request


# Not frozen: a frozen dataclass's __init__ costs 3x, and one is made per replica at every
# arrival. Routers only read it.
@dataclass(slots=True)
class ReplicaLoad:
    """A replica as a router sees it when a request arrives."""

    num_outstanding: int  # requests queued, running, or on their way to it
    num_load_tokens: int  # tokens of work queued (still to compute) or resident in its KV
    # Tokens of the arriving request cached there (only for routers that ask for them).
    num_prefix_hit_tokens: int = 0
    num_waiting: int = 0  # requests queued (an engine's waiting queue)
    num_running: int = 0  # requests in its running batch
    kv_usage: float = 0.0  # share of its KV blocks in use


class RouterConfig(BaseModel):
    model_config = INPUT_MODEL
    name: str


class Router(ABC):
    Config: ClassVar[type[RouterConfig]] = RouterConfig
    # Whether `choose` reads `ReplicaLoad.num_prefix_hit_tokens` (a cache lookup per replica).
    needs_prefix_hits: ClassVar[bool] = False
    # Whether `choose` reads the loads at all (not only how many there are): a router that
    # does not leaves the other replicas unread at each arrival (`Replica.unobserved`).
    reads_loads: ClassVar[bool] = True

    def __init__(self, config: RouterConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng

    @abstractmethod
    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        """Index of the replica (in `loads`) that gets `req`, when it arrives."""

    def choose_at(self, req: Request, loads: Sequence[ReplicaLoad], now_s: float) -> int:
        """`choose` at `now_s`, later than `req`'s arrival (a decode pool's pick, once its
        prompt is done). A router that keeps time by arrivals overrides it."""
        return self.choose(req, loads)


ROUTERS: Registry[type[Router]] = Registry("router", "sim.routers", "ROUTERS")


class LazyLoads(Sequence[ReplicaLoad]):
    """The loads the engine gives a router (`sim.engine.cluster.Loads`): each replica's made
    when first read, and `load_tokens`, each one's `num_load_tokens` alone."""

    def load_tokens(self) -> list[int]:
        """Each replica's `num_load_tokens`, without making its whole `ReplicaLoad` where the
        engine can (a router weighing tokens reads every replica at every arrival)."""
        return [load.num_load_tokens for load in self]


def load_tokens(loads: Sequence[ReplicaLoad]) -> list[int]:
    """Each replica's `num_load_tokens`: from the engine's `LazyLoads` at its cost, else read."""
    if isinstance(loads, LazyLoads):
        return loads.load_tokens()
    return [load.num_load_tokens for load in loads]


def argmin_first(values: Sequence[int]) -> int:
    """Index of the smallest value; ties go to the lowest index (deterministic)."""
    return values.index(min(values))
