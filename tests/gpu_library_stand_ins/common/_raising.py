"""Module attributes that raise when called: stand-ins for GPU libraries in CPU test runs."""


class CalledOnTheCPU(RuntimeError):
    pass


def raising_getattr(module: str):
    """A module `__getattr__`: every public name is a function that raises when called."""
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def called(*args, **kwargs):
            raise CalledOnTheCPU(f"{module}.{name} was called in a CPU test: on the GPU machine the real "
                                 f"library would run on CPU tensors (an illegal memory access there)")
        return called
    return __getattr__
