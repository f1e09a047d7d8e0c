"""kvserve: an LLM serving engine built around its KV cache."""

from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.engine.request import CompletionOutput, RequestOutput
from kvserve.llm import LLM
from kvserve.lora.adapter import LoRARequest

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
