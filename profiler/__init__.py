"""The profiler: measure real iterations on a device (`measure`), fit a latency model to them
(`fit`), and close the loop (`replay`: serve for real, then validate the simulator against it).
`commands` is what `servesim profile` and `servesim fit` do.
"""
