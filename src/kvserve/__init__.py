"""kvserve: an LLM serving engine built around its KV cache."""

from kvserve.engine.params import SamplingParams
from kvserve.engine.request import RequestOutput
from kvserve.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
