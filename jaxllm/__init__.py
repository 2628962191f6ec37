"""jaxllm: LLM inference and serving in JAX and Pallas.

    from jaxllm import LLM, SamplingParams

Names resolve lazily so that the control plane (jaxllm.core) imports without JAX.
"""

from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "LoRARequest"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxllm.engine.llm import LLM
        return LLM
    if name == "EngineArgs":
        from jaxllm.engine.args import EngineArgs
        return EngineArgs
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
