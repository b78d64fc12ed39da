"""The cluster (`sim.engine.cluster`): what routers read of the replicas (`Loads`), each load
read once and lazily."""

from __future__ import annotations

from sim.core.request import Request
from sim.engine.cluster import Loads
from sim.routers.base import ReplicaLoad


class Counted:
    """A stand-in replica that counts how often its load is read."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.reads = 0

    def load(self, req: Request | None = None) -> ReplicaLoad:
        self.reads += 1
        return ReplicaLoad(1, self.tokens)


def test_loads_are_read_once_each_whether_iterated_or_indexed():
    replicas = [Counted(t) for t in (30, 10, 20)]
    loads = Loads(replicas, None)  # type: ignore[arg-type]
    assert loads[2].num_load_tokens == 20
    assert [load.num_load_tokens for load in loads] == [30, 10, 20]
    assert [load.num_load_tokens for load in loads[0:2]] == [30, 10]
    assert [r.reads for r in replicas] == [1, 1, 1]
    untouched = [Counted(5), Counted(6)]
    assert len(Loads(untouched, None)) == 2  # type: ignore[arg-type]
    assert [r.reads for r in untouched] == [0, 0]
