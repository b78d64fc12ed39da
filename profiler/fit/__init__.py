"""Fitting the profile latency model to measured iterations and scoring it on held-out mixes
(`fitting`).
"""
