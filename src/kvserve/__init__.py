"""kvserve: an LLM serving engine built around its KV cache."""

from kvserve.engine.params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from kvserve.engine.request import CompletionOutput, Logprob, RequestOutput
from kvserve.llm import LLM

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"
