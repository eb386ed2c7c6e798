from _raising import raising_getattr

__getattr__ = raising_getattr("transformer_engine_torch")
