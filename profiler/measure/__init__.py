"""Measuring real iterations: the decoder built from a model's shape with random weights
(`model`), the batch mixes it is timed on (`mixes`), timing them resumably (`timing`), one
layer's GEMMs (`gemm_timing`), and the device set-up (`device`). Torch only here and below.
"""
