"""What a replica runs on: model shapes (Hugging Face configs), GPU datasheets, and how a
replica splits over GPUs (tensor, pipeline, expert parallelism).
"""
