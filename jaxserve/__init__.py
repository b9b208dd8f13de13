"""jaxserve: an LLM serving engine on JAX/XLA.

`LLM` is imported lazily, so host-side modules (config, kv, scheduler, sampling
params) can be imported without pulling in JAX.
"""

from jaxserve.lora import LoRARequest
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
