"""The SimPy engine, which owns time: the clock and the order of events at an instant, a replica
stepping its scheduler's plans (`replica`), pipelined and async replicas with batches in flight
(`pipeline`), clusters of replicas behind a router (`cluster`), prefill and decode pools joined
by KV transfers (`disaggregation`) and the per-iteration log. `fastpath` runs predictable
stretches of iterations in one step, exactly as stepping would.
"""
