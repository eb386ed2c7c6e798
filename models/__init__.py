"""Models used by the demo, the tests and the benchmarks."""
from .llama import Llama, LlamaBlock, LlamaConfig

__all__ = ["Llama", "LlamaBlock", "LlamaConfig"]
