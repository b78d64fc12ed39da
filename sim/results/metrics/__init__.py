"""Statistics of a run's tables: the summary (`summary`), latencies over arrived requests
(`arrived`), the overload verdict (`overload`), warm-up (`warmup`), confidence intervals over
replications (`intervals`) and paired differences (`paired`).
"""
