"""The mesh axis names, in a leaf module that models and sharding rules both import."""

DATA = "data"  # DP ranks
TENSOR = "tensor"  # tensor parallelism: heads, MLP columns/rows, vocab, KV heads
AXES = (DATA, TENSOR)
