"""The fast path: a stretch of iterations that no event can change, planned, timed and committed
at once (`stretch`, `commit`), exactly equal to stepping them one by one.
"""
