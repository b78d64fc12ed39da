"""The simulator's kernel, without SimPy, a clock or torch: a request as token counters, the
plan of one iteration, a replica's state (queues, KV cache, applying a plan) and the KV managers
(paged blocks; vLLM's block-level prefix cache; SGLang's radix cache), plus the registry every
pluggable kind (scheduler, latency model, router, workload format) uses.
"""
