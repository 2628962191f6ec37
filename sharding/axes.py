"""The mesh axis names, in a leaf module that models and sharding rules both import."""

DATA = "data"  # DP ranks
PIPE = "pipe"  # pipeline stages: each runs its own layers on its own devices
TENSOR = "tensor"  # tensor parallelism: heads, MLP columns/rows, vocab, KV heads
MESH_AXES = (DATA, PIPE, TENSOR)  # an engine's whole mesh (sharding/mesh.make_mesh)
AXES = (DATA, TENSOR)  # the mesh one program runs on: one pipeline stage's devices
