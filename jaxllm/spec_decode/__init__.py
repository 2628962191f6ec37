"""Speculative decoding's draft proposers (host side; the draft model's, which runs an engine of
its own, is jaxllm/engine/draft_proposer.py). The config is SpeculativeConfig in
jaxllm/config.py; verification runs in the step (jaxllm/sample/rejection.py)."""
