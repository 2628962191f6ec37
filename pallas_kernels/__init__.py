"""Pallas GPU kernels for jaxllm, each with a pure-jnp reference beside it."""
