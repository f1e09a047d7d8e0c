"""kvserve: an LLM serving engine built around its KV cache."""

from kvserve.engine.params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from kvserve.engine.request import CompletionOutput, Logprob, RequestOutput
from kvserve.llm import LLM
from kvserve.lora.adapter import LoRARequest

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "Logprob", "LoRARequest", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
