"""Cache-aware routing: send a request where the longest prefix of it is cached, unless the
replicas' loads are out of balance (SGLang's router, `cache_aware` policy).

Rules (from sgl-model-gateway's cache-aware policy and its `router_args.py` defaults):
1. Imbalanced (both `max - min > balance_abs_threshold` and `max > balance_rel_threshold * min`
   over requests in flight): the replica with the fewest requests in flight.
2. Otherwise, the replica holding the longest cached prefix of the request, if that prefix is
   at least `cache_threshold` of its prompt (ties: fewer requests in flight, then lower index).
3. Otherwise, the replica with the least KV load (SGLang picks the worker whose tree is smallest,
   i.e. with the most room to cache this request).
SGLang's router keeps an approximate tree of the text it routed; this router reads each
replica's actual cache (what SGLang's gateway calls exact mirroring), so it never routes to a
prefix that was evicted. Without prefix caching or hash ids every match is 0: rule 3 applies.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from sim.core.request import Request
from sim.routers.base import ROUTERS, ReplicaLoad, Router, RouterConfig, argmin_first


class PrefixAffinityConfig(RouterConfig):
    cache_threshold: float = Field(0.3, ge=0, le=1,
                                   description="least cached share of the prompt to follow it")
    balance_abs_threshold: int = Field(64, ge=0, description="requests in flight, max - min",
                                       json_schema_extra={"unit": "requests"})
    balance_rel_threshold: float = Field(1.5, ge=1, description="max / min requests in flight")


@ROUTERS.register("prefix_affinity")
class PrefixAffinity(Router):
    Config = PrefixAffinityConfig
    config: PrefixAffinityConfig
    needs_prefix_hits = True

    def choose(self, req: Request, loads: Sequence[ReplicaLoad]) -> int:
        cfg = self.config
        outstanding = [load.num_outstanding for load in loads]
        most, least = max(outstanding), min(outstanding)
        if most - least > cfg.balance_abs_threshold and most > cfg.balance_rel_threshold * least:
            return argmin_first(outstanding)
        best = min(range(len(loads)),
                   key=lambda i: (-loads[i].num_prefix_hit_tokens, outstanding[i], i))
        if loads[best].num_prefix_hit_tokens >= cfg.cache_threshold * req.num_prompt_tokens > 0:
            return best
        return argmin_first([load.num_load_tokens for load in loads])
