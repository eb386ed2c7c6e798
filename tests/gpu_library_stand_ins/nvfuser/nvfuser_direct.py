from _raising import raising_getattr

__getattr__ = raising_getattr("nvfuser_direct")
