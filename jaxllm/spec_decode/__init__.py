"""Speculative decoding's draft proposers (host side). The config is SpeculativeConfig in
jaxllm/config.py; verification runs in the step (jaxllm/sample/rejection.py)."""
