"""The cluster (`sim.engine.cluster`): what routers read of the replicas (`Loads`), each load
read once and lazily."""

from __future__ import annotations

from sim import run_scenario
from sim.config.scenario import parse_scenario
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


class Tokens(Counted):
    """... that also gives its tokens alone, counted apart."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.token_reads = 0

    def load_tokens(self) -> int:
        self.token_reads += 1
        return self.tokens


def test_a_router_weighing_tokens_reads_each_replicas_tokens_alone():
    replicas = [Tokens(t) for t in (30, 10, 20)]
    loads = Loads(replicas, None)  # type: ignore[arg-type]
    assert loads[1].num_load_tokens == 10  # a load read already is not read again
    assert loads.load_tokens() == [30, 10, 20]
    assert [(r.reads, r.token_reads) for r in replicas] == [(0, 1), (1, 0), (0, 1)]
    # With the arriving request (prefix hits), each whole load, as read.
    with_hits = Loads([Tokens(5), Tokens(6)], Request(0, 0.0, 8, 2))  # type: ignore[list-item]
    assert with_hits.load_tokens() == [5, 6]
    assert [(r.reads, r.token_reads) for r in with_hits.replicas] == [(1, 0), (1, 0)]


def test_the_tokens_a_router_reads_are_those_of_each_replicas_load(traces):
    """Four replicas behind least_kv_load at 4x the Azure conversation trace's rate, fast path:
    at every arrival each replica's `load_tokens` (its stretch's ended counts, its iteration
    in flight, or a sync) equals what its whole `load()` reads then."""
    data = {"seed": 0,
            "workload": {"format": "azure", "num_requests": 600, "rate_scale": 4.0,
                         "path": str(traces / "azure_llm_2023" /
                                     "AzureLLMInferenceTrace_conv.csv")},
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                        "scheduler": {"name": "chunked_prefill", "token_budget": 512},
                        "latency": {"kind": "roofline"}},
            "cluster": {"replicas": 4, "router": {"name": "least_kv_load"}}}
    checked = []
    load_tokens = Loads.load_tokens

    def checking(self: Loads) -> list[int]:
        tokens = load_tokens(self)
        assert tokens == [replica.load().num_load_tokens for replica in self.replicas]
        checked.append(type(self.replicas[0]).__name__)
        return tokens

    Loads.load_tokens = checking  # type: ignore[method-assign]
    try:
        run_scenario(parse_scenario(data, "test"))
    finally:
        Loads.load_tokens = load_tokens  # type: ignore[method-assign]
    assert len(checked) == 600 and set(checked) == {"FastReplica"}
