"""fp8 scaling for the `te` executor: current (stateless) and delayed, one `DelayedScalingState` per jitted model. The
custom ops reach it through an integer handle, so to the compiler the graph stays a pure function of its inputs."""

import functools
import itertools
import warnings
import weakref

import torch

_STATES: "weakref.WeakValueDictionary[int, DelayedScalingState]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def te_dtype(name: str):
    import transformer_engine_torch as tex
    return tex.DType.kFloat8E4M3 if name == "e4m3" else tex.DType.kFloat8E5M2


@functools.cache
def current_quantizer(name: str, columnwise: bool = True):
    """A stateless current-scaling quantizer, for every linear; `columnwise`: also the transpose (dy's, for wgrad)."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    q = Float8CurrentScalingQuantizer(te_dtype(name), torch.device("cuda"), rowwise=True, columnwise=columnwise)
    q.internal = True
    return q


def recipe_formats(recipe) -> tuple[str, str]:
    """(forward, backward) fp8 format of a TE recipe: HYBRID is E4M3 forward, E5M2 backward."""
    if (fmt := getattr(getattr(recipe, "fp8_format", None), "name", "HYBRID")) not in _FORMATS:
        raise NotImplementedError(f"te.fp8: fp8_format {fmt} is not supported; use Format.HYBRID or Format.E4M3")
    return _FORMATS[fmt]


class _Stack:
    """amax histories [L, n] and scales [n] of one direction's n tensors, in chunks: later linears get a new chunk, so
    buffers never move (recorded CUDA graphs and quantizers point at them); a linear's columns lie in one chunk."""

    def __init__(self, per_linear: int, fmt: str, columnwise: bool):
        self.per_linear, self.fmt, self.columnwise = per_linear, fmt, columnwise
        # cold: casts use current scaling (a scale of 1 flushes small gradients to 0) and record amaxes for the scales
        self.cold, self.recorded = True, False
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (history [L, n_k], scale [n_k])
        self.quantizers: dict[int, object] = {}  # column -> quantizer on views of the buffers

    @property
    def columns(self) -> int:
        return sum(scale.numel() for _, scale in self.chunks)

    def ensure(self, n_linears: int, history_len: int, device) -> None:
        if (missing := n_linears * self.per_linear - self.columns) > 0:
            self.chunks.append((torch.zeros(history_len, missing, dtype=torch.float32, device=device),
                                torch.ones(missing, dtype=torch.float32, device=device)))

    def view(self, column: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(history [L, width], scale [width]) of `width` columns from `column`, views of the buffers."""
        for history, scale in self.chunks:
            if column < scale.numel():
                return history[:, column:column + width], scale[column:column + width]
            column -= scale.numel()
        raise IndexError(f"te fp8 state: column {column} was never allocated")

    def quantizer(self, column: int):
        if (q := self.quantizers.get(column)) is None:
            from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
            history, scale = self.view(column, 1)
            q = Float8Quantizer(scale[0], history[0], te_dtype(self.fmt), rowwise=True, columnwise=self.columnwise)
            q.internal = True
            self.quantizers[column] = q
        return q


class DelayedScalingState:
    """Delayed-scaling state of one jitted model's TE linears (see the module docstring)."""

    def __init__(self, recipe):
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            raise NotImplementedError("te.fp8(DelayedScaling): custom amax_compute_algo / scaling_factor_compute_algo "
                                      "callables are not supported; use amax_compute_algo='max' or 'most_recent'")
        self.recipe = recipe
        fwd, bwd = recipe_formats(recipe)
        self.forward, self.backward = _Stack(2, fwd, False), _Stack(1, bwd, True)  # columns: [x, W] / [dy] per linear
        self.names: dict[str, int] = {}            # linear name (its weight's qualname) -> index
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # loaded before the linear was compiled
        self.ran: set[int] = set()                 # indices of linears that ran (state worth saving)
        self.handle, self.warned = next(_ids), False  # warned: once, of loaded state matching no linear
        _STATES[self.handle] = self

    def register(self, name: str) -> int:
        """The index of the linear named `name` (a weight used by several linears shares its state)."""
        return self.names.setdefault(name, len(self.names))

    def allocate(self, device) -> None:
        """Buffers for every linear registered so far: at compile time, and at a cast (a linear may register since)."""
        n, length = len(self.names), self.recipe.amax_history_len
        if self.forward.columns < 2 * n:
            first = self.forward.columns == 0
            self.forward.ensure(n, length, device)
            self.backward.ensure(n, length, device)
            loaded = [name for name in self.pending if name in self.names]
            for name in loaded:
                self._load(name, self.pending.pop(name))
            if first and loaded:
                # loaded amaxes (the last saved step's) are not in the scales yet: folded in now, as the next call did
                self.forward.cold = self.backward.cold = False
                self.update()

    def forward_quantizers(self, index: int, device):
        self.allocate(device)
        self.ran.add(index)
        if self.forward.cold:
            return current_quantizer(self.forward.fmt, False), current_quantizer(self.forward.fmt, False)
        return self.forward.quantizer(2 * index), self.forward.quantizer(2 * index + 1)

    def backward_quantizer(self, index: int, device):
        self.allocate(device)
        return current_quantizer(self.backward.fmt) if self.backward.cold else self.backward.quantizer(index)

    def recorded_forward(self, index: int, x: torch.Tensor, w: torch.Tensor) -> None:
        """After the forward casts: while cold, the amaxes of x and W go into the history."""
        if self.forward.cold:
            self._record(self.forward, 2 * index, x)
            self._record(self.forward, 2 * index + 1, w)

    def recorded_backward(self, index: int, dy: torch.Tensor) -> None:
        if self.backward.cold:
            self._record(self.backward, index, dy)

    @staticmethod
    def _record(stack: "_Stack", column: int, t: torch.Tensor) -> None:
        """`t`'s amax into the newest history row, measured: a current-scaling cast of 0s says scale 1, not amax 0."""
        row = stack.view(column, 1)[0][0]
        torch.maximum(row, t.abs().amax().float().reshape(1), out=row)
        stack.recorded = True

    def update(self) -> None:
        """New scales from the amaxes recorded since the last update; clears the newest history row."""
        for stack in (self.forward, self.backward):
            if not stack.chunks:
                continue
            if stack.recorded:  # a direction stays cold until a call of it recorded amaxes
                stack.cold, stack.recorded = False, False
            try:
                import transformer_engine_torch as tex
            except ImportError:
                tex = None
            if tex is not None and all(h.is_cuda for h, _ in stack.chunks):
                tex.fused_amax_and_scale_update_after_reduction(
                    torch.cat([h[0] for h, _ in stack.chunks]), [h for h, _ in stack.chunks],
                    [s for _, s in stack.chunks], self.recipe.amax_compute_algo, te_dtype(stack.fmt),
                    self.recipe.margin)
            else:  # no TE, or state off the GPU (CPU tests; TE's kernel would misread host memory): the same in torch
                for history, scale in stack.chunks:
                    _update_reference(history, scale, self.recipe, _FP8_MAX[stack.fmt])

    # -- state dict: `<module>._extra_state.<attr>_fp8_scale` [x, W, dy] and `..._fp8_amax_history` [L, 3]
    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        if not self.forward.chunks:
            return dict(self.pending)
        if self.pending and not self.warned:
            self.warned = True
            warnings.warn(f"te fp8: loaded scaling state for {sorted(self.pending)} matched no linear that ran "
                          f"(kept, and saved again). Grouped linears (te's default) keep one state under the group's "
                          f"first member: load a checkpoint with the te.options(group_linears=...) it was saved with")
        out = dict(self.pending)
        for name, i in self.names.items():
            if i in self.ran:  # one registered but not run yet has nothing to save
                (fh, fs), (bh, bs) = self.forward.view(2 * i, 2), self.backward.view(i, 1)
                out[name] = {"fp8_scale": torch.cat([fs, bs]).clone(),
                             "fp8_amax_history": torch.cat([fh, bh], dim=1).clone()}
        return out

    def load(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        if name in self.names and 2 * self.names[name] + 2 <= self.forward.columns:
            self._load(name, tensors)
        else:
            self.pending[name] = tensors

    def _load(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        i = self.names[name]
        self.ran.add(i)  # loaded state is saved again even before the linear runs
        scale, history = tensors["fp8_scale"], tensors["fp8_amax_history"]
        if tuple(history.shape) != (self.recipe.amax_history_len, 3) or scale.numel() != 3:
            raise ValueError(f"te fp8 state of {name}: amax history {tuple(history.shape)} and scales "
                             f"{tuple(scale.shape)} do not fit this recipe (expected "
                             f"({self.recipe.amax_history_len}, 3) and (3,): its amax_history_len)")
        (fh, fs), (bh, bs) = self.forward.view(2 * i, 2), self.backward.view(i, 1)
        for mine, loaded in ((fs, scale[:2]), (bs, scale[2:]), (fh, history[:, :2]), (bh, history[:, 2:])):
            mine.copy_(loaded)


_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
_FORMATS = {"HYBRID": ("e4m3", "e5m2"), "E4M3": ("e4m3", "e4m3")}  # fp8_format -> (forward, backward) format


def _update_reference(history: torch.Tensor, scale: torch.Tensor, recipe, fp8_max: float) -> None:
    """TE's delayed-scaling update, as its unfused path computes it."""
    amax = history.max(0).values if recipe.amax_compute_algo == "max" else history[0].clone()
    if history.shape[0] > 1:
        history.copy_(torch.roll(history, -1, 0))
    history[0].fill_(0.0)
    new = torch.where((amax > 0) & torch.isfinite(amax), fp8_max / amax / 2 ** recipe.margin, scale)
    scale.copy_(torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max), new))


def delayed_state(handle: int) -> DelayedScalingState:
    return _STATES[handle]
