"""Models used by the demo, the tests and the benchmarks."""
from .llama import LanguageModelLoss, Llama, LlamaBlock, LlamaConfig

__all__ = ["LanguageModelLoss", "Llama", "LlamaBlock", "LlamaConfig"]
