"""`jaxllm bench`: vLLM's latency, throughput and serving benchmarks, and the roofline floors."""
