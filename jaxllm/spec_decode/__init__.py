"""Speculative decoding's host-side draft proposer (n-gram; draft models and EAGLE heads draft on
device: jaxllm/worker/drafter.py). The config is SpeculativeConfig in
jaxllm/config.py; verification runs in the step (jaxllm/sample/rejection.py)."""
