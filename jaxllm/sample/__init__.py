"""On-device sampling: per-request parameters as arrays, penalties, logprobs."""

from jaxllm.sample.logprobs import LogprobsTensors, gather_logprobs
from jaxllm.sample.metadata import (MAX_MIN_TOKENS_STOP_IDS, SamplingMetadata,
                                    build_sampling_metadata, check_min_tokens_stop_ids)
from jaxllm.sample.penalties import PenaltyState, init_penalty_state, record_tokens
from jaxllm.sample.sampler import SamplerOutput, sample

__all__ = ["LogprobsTensors", "MAX_MIN_TOKENS_STOP_IDS", "PenaltyState", "SamplerOutput",
           "SamplingMetadata", "build_sampling_metadata", "check_min_tokens_stop_ids",
           "gather_logprobs", "init_penalty_state", "record_tokens", "sample"]
