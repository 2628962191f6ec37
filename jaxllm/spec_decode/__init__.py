"""Speculative decoding: its config, the proposers and the scheduler-side statistics (host side;
verification runs in the step, jaxllm/sample/rejection.py)."""
