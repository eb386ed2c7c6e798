"""The `te` executor: linear layers through Transformer Engine GEMMs, in bf16 or fp8. Before autodiff, linears become
the custom op `pipeline_te::linear` with its own autograd (`pipeline_te::linear_backward`), each one op to AOTAutograd.

    pipeline.jit(model, executors=[te.fp8(DelayedScaling()), "inductor"])   # or te (bf16), te.fp8() (current)

Recipes, fp8 formats, the delayed-scaling state (`te_scaling.py`), what TE does not take: docs/executors.md."""

import math
import operator
from typing import Optional, Sequence

import torch
import torch.fx as fx

from ir import Trace, fake_like, node_value
from ir.rewrite import Call, Match, add_call, match, rewrite
from ir.torch_ops import LINEAR

from .base import PerModel, RebuiltFromGraph, PreparesGraph, cuda_library_missing, library_version
from .claims import ClaimTable
from .te_scaling import DelayedScalingState, current_quantizer, delayed_state, recipe_formats, te_dtype


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fp8: bool,
              scaling: int, index: int) -> list[torch.Tensor]:
    """[y] in bf16; [y, x scale_inv, W scale_inv] in fp8 (the backward casts x and W again with these, in the graph:
    `_transposed_fp8`). `scaling`: -1 (current scaling) or a `DelayedScalingState`'s handle; `index`: its linear."""
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    x2 = x.reshape(-1, x.shape[-1])
    shape = (*x.shape[:-1], weight.shape[0])
    if not fp8:
        return [general_gemm(weight, x2, out_dtype=x.dtype, layout="TN", bias=bias)[0].view(shape)]
    if (state := delayed_state(scaling) if scaling >= 0 else None) is None:
        qx = qw = current_quantizer("e4m3", columnwise=False)
    else:
        qx, qw = state.forward_quantizers(index, x.device)
    xq, wq = qx(x2.contiguous()), qw(weight.contiguous())
    if state is not None:
        state.recorded_forward(index, x2, weight)
    y = general_gemm(wq, xq, out_dtype=x.dtype, layout="TN", bias=bias, use_split_accumulator=False)[0]
    return [y.view(shape), xq._scale_inv.clone(), wq._scale_inv.clone()]


te_linear = torch.library.custom_op("pipeline_te::linear", mutates_args=())(_linear)


@te_linear.register_fake
def _linear_fake(x, weight, bias, fp8, scaling, index):
    y = x.new_empty(*x.shape[:-1], weight.shape[0])
    return [y, x.new_empty(1, dtype=torch.float32), x.new_empty(1, dtype=torch.float32)] if fp8 else [y]


def _fp8_saved_values(x, weight, fp8: bool) -> list:
    """The fake values `pipeline_te::linear` returns beside y (the scales of its fp8 casts)."""
    if not fp8:
        return []
    import contextlib
    with getattr(x, "fake_mode", None) or contextlib.nullcontext():
        return _linear_fake(x, weight, None, fp8, -1, -1)[1:]


def _linear_backward(dy: torch.Tensor, saved: list[torch.Tensor], has_bias: bool, fp8: bool,
                       scaling: int, index: int) -> list[torch.Tensor]:
    """[dx, dW] (+ [db]) from dy and what the forward saved."""
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
    if not fp8:
        x, weight = saved
        dx = general_gemm(weight, dy2, out_dtype=dy.dtype, layout="NN", grad=True, use_split_accumulator=True)[0]
        dw, db = general_gemm(x.reshape(-1, x.shape[-1]), dy2, out_dtype=weight.dtype, layout="NT", grad=True,
                              bias=dy2[0] if has_bias else None, use_split_accumulator=True)[:2]
        k = weight.shape[1]
    else:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
        x_t, x_si, w_t, w_si = saved
        if scaling < 0:
            e4m3, gq = te_dtype("e4m3"), current_quantizer("e5m2")
        else:
            state = delayed_state(scaling)
            e4m3, gq = te_dtype(state.forward.fmt), state.backward_quantizer(index, dy.device)
        xq = Float8TensorStorage(data=None, data_transpose=x_t, fp8_scale_inv=x_si, fp8_dtype=e4m3, fake_dtype=dy.dtype)
        wq = Float8TensorStorage(data=None, data_transpose=w_t, fp8_scale_inv=w_si, fp8_dtype=e4m3, fake_dtype=dy.dtype)
        db, dyq = tex.bgrad_quantize(dy2, gq) if has_bias else (None, gq(dy2))
        if scaling >= 0:
            state.recorded_backward(index, dy2)
        dx = general_gemm(wq, dyq, out_dtype=dy.dtype, layout="NN", grad=True, use_split_accumulator=True)[0]
        dw = general_gemm(xq, dyq, out_dtype=dy.dtype, layout="NT", grad=True, use_split_accumulator=True)[0]
        k = w_t.shape[0]
    out = [dx.view(*dy.shape[:-1], k), dw]
    return out + [db.to(dy.dtype)] if has_bias else out


te_linear_backward = torch.library.custom_op("pipeline_te::linear_backward", mutates_args=())(_linear_backward)


@te_linear_backward.register_fake
def _(dy, saved, has_bias, fp8, scaling, index):
    k, n = (saved[2].shape[0] if fp8 else saved[1].shape[1]), dy.shape[-1]
    out = [dy.new_empty(*dy.shape[:-1], k), dy.new_empty(n, k)]
    return out + [dy.new_empty(n)] if has_bias else out


def _setup_context(ctx, inputs, output):
    x, weight, bias, fp8, scaling, index = inputs
    ctx.fp8, ctx.has_bias, ctx.scaling, ctx.index = fp8, bias is not None, scaling, index
    ctx.save_for_backward(x, weight, *output[1:])


def _transposed_fp8(t: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """t [m, k] cast to E4M3 with the forward's scale, transposed [k, m], as bytes, in torch ops: the partitioner can
    recompute t (an RMSNorm output) in the backward, the cast fused, not keep t or its fp8 copy (as torchao)."""
    limit = torch.finfo(torch.float8_e4m3fn).max
    return (t.float() / scale_inv).clamp(-limit, limit).to(torch.float8_e4m3fn).view(torch.uint8).t().contiguous()


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    if ctx.fp8:
        x, weight, x_si, w_si = saved
        saved = [_transposed_fp8(x.reshape(-1, x.shape[-1]), x_si), x_si, _transposed_fp8(weight, w_si), w_si]
    grads = torch.ops.pipeline_te.linear_backward(grads[0], saved, ctx.has_bias, ctx.fp8, ctx.scaling, ctx.index)
    return grads[0], grads[1], (grads[2] if ctx.has_bias else None), None, None, None


te_linear.register_autograd(_backward, setup_context=_setup_context)


MATMUL = Call((operator.matmul, torch.matmul), ("input", "other"), input="x", other="w")  # taken as a linear
STACKED = Call(torch.cat, ("tensors", "dim"), tensors="ws")  # grouped linears' weights: fp8 state named after the first
TRANSPOSED = Call("contiguous", ("input",), input=Call(torch.t, ("input",), input="w"))  # of x @ W: named after W


_CLAIMS = ClaimTable()
_CLAIMS.register(torch.ops.pipeline_te.linear.default, torch.ops.pipeline_te.linear_backward.default)


class TEExecutor(RebuiltFromGraph, PerModel, PreparesGraph):
    name = "te"
    kind = "operator"
    claims_table = _CLAIMS

    def __init__(self, fp8: bool = False, recipe=None, group_linears: bool | None = None):
        self.use_fp8, self.recipe, self.grouping = fp8, recipe, group_linears  # grouping None: by fp8 (see options)
        self.scaling: DelayedScalingState | None = None  # per jitted model, see for_model
        self.state_device: str | None = None  # where `_allocate_state` put what the ops keep

    @property
    def group_linears(self) -> bool:
        return self.use_fp8 if self.grouping is None else self.grouping

    def options(self, *, group_linears: bool | None = ...) -> "TEExecutor":
        """`group_linears=True`: linears reading one input (q/k/v, gate/up) become one TE GEMM on stacked weights, one
        fp8 state under the first's module; `False`: one GEMM each; `None` (default): in fp8 (a shared cast pays)."""
        group_linears = self.grouping if group_linears is ... else group_linears
        return TEExecutor(fp8=self.use_fp8, recipe=self.recipe, group_linears=group_linears)

    def fp8(self, recipe=None) -> "TEExecutor":
        """The fp8 variant. `recipe`: None or `Float8CurrentScaling()` (current scaling), or `DelayedScaling(...)`."""
        kind = type(recipe).__name__
        if recipe is not None and kind not in ("Float8CurrentScaling", "DelayedScaling"):
            raise TypeError(f"te.fp8: recipe {kind} is not supported; use transformer_engine.common.recipe."
                            f"DelayedScaling(...) or Float8CurrentScaling(), or None for current scaling")
        if recipe is not None:
            recipe_formats(recipe)  # rejects formats the ops do not implement
        return TEExecutor(fp8=True, recipe=recipe if kind == "DelayedScaling" else None, group_linears=self.grouping)

    def cache_token(self) -> str:
        return (f"te {library_version('transformer_engine')} fp8={self.use_fp8} recipe={self.recipe!r} "
                f"group_linears={self.group_linears}")

    def for_model(self) -> "TEExecutor":
        if self.recipe is None:
            return self
        copy = TEExecutor(fp8=True, recipe=self.recipe, group_linears=self.grouping)
        copy.scaling = DelayedScalingState(self.recipe)
        return copy

    def before_call(self) -> None:
        if self.scaling is not None:
            self.scaling.update()

    def extra_state(self) -> dict[str, torch.Tensor]:
        state = self.scaling.state() if self.scaling is not None else {}
        return {_extra_key(name, suffix): t for name, tensors in state.items() for suffix, t in tensors.items()}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> set[str]:
        if self.scaling is None:
            return set()
        taken, by_name = set(), {}
        for key, value in state.items():
            for suffix in ("fp8_scale", "fp8_amax_history"):
                if "._extra_state." in f".{key}" and key.endswith("_" + suffix):
                    module, attr = key.rsplit("_extra_state.", 1)
                    by_name.setdefault(module + attr[:-len(suffix) - 1], {})[suffix] = value
                    taken.add(key)
        for name, tensors in by_name.items():
            if len(tensors) != 2:
                raise ValueError(f"te fp8 state of {name}: the state dict has {sorted(tensors)} but needs both "
                                 f"fp8_scale and fp8_amax_history")
            self.scaling.load(name, tensors)
        return taken

    def unavailable_reason(self) -> str | None:
        modules = ["transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions"]
        return cuda_library_missing("Transformer Engine", modules, "install Transformer Engine on a CUDA machine")

    def flops(self, node: fx.Node) -> tuple[int, bool] | None:
        """GEMM FLOPs of a `pipeline_te` op (a linear: one GEMM; its backward: dgrad and wgrad) and whether in fp8."""
        if node.target not in _CLAIMS:
            return None
        fp8 = bool(node.args[3])
        try:
            if node.target is torch.ops.pipeline_te.linear.default:
                x, w = node_value(node.args[0]).shape, node_value(node.args[1]).shape
                return 2 * (math.prod(x) // x[-1]) * x[-1] * w[0], fp8
            dy, k = node_value(node.args[0]).shape, node_value(node)[0].shape[-1]
            return 4 * math.prod(dy) * k, fp8
        except (TypeError, IndexError, AttributeError):  # symbolic sizes, no metadata: not counted
            return None

    def compile_region(self, gm: fx.GraphModule, example_inputs: Sequence):
        """The region calling its ops' Python code: past AOTAutograd, the dispatcher's autograd and alias checks are not
        needed (~15 us a call). A one-op region is a closure: no code to generate (130 at a 1B model's warm start)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        op, *picks, output = list(gm.graph.nodes)[len(placeholders):]
        if op.target in _IMPLEMENTATIONS and not op.kwargs and isinstance(output.args[0], tuple) and all(
                n.target is operator.getitem and n.args[0] is op for n in picks) and set(output.args[0]) <= set(picks):
            return _one_op(op, placeholders, [n.args[1] for n in output.args[0]])
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        for node in graph.nodes:
            node.target = _IMPLEMENTATIONS.get(node.target, node.target)
        return fx.GraphModule(gm, graph).forward

    def passes_before_prepare(self) -> tuple[str, ...]:
        return ("group_linears",) if self.group_linears else ()

    def prepare(self, trace: Trace) -> tuple[Trace, list[tuple[str, str]]]:
        """Swaps linears TE takes (`x @ W` too, W a 2-D parameter) for `pipeline_te::linear`; (op, why) for the rest."""
        gm, notes = trace.editable(), []
        specs = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], trace.inputs))  # what each input is
        rewrite(gm.graph, [(MATMUL, lambda m: self._matmul_as_linear(m, notes), lambda m: _by_weight(m, specs))])
        swapped = rewrite(gm.graph, [(LINEAR, lambda m: self._swap(m, trace, specs),
                                      lambda m: self._takes(m.root, "linear", notes))])
        gm.recompile()
        if swapped:  # the state allocated below goes to the device of the linears swapped
            self._allocate_state(node_value(swapped[-1].root).device)
        return trace.derive(gm, by="te.swap_linears" + ("(fp8)" if self.use_fp8 else "")), notes

    def _swap(self, m: Match, trace: Trace, specs: dict) -> None:
        node, graph, y = m.root, m.root.graph, node_value(m.root)
        with graph.inserting_before(node):  # delayed scaling: the linear's state, registered by name
            scaling, index = ((self.scaling.handle, self.scaling.register(_linear_name(trace, m, specs)))
                              if self.scaling is not None else (-1, -1))
            call = add_call(graph, torch.ops.pipeline_te.linear.default, (m["x"], m["w"], m["b"], self.use_fp8, scaling,
                            index), [y] + _fp8_saved_values(m.value("x"), m.value("w"), self.use_fp8))
            first = add_call(graph, operator.getitem, (call, 0), y)
        node.replace_all_uses_with(first)
        graph.erase_node(node)

    def binding(self) -> tuple:
        """The delayed-scaling handle and linears' indices `prepare` gave the ops, and the device of their state."""
        return (self.scaling.handle, dict(self.scaling.names)) if self.scaling else (-1, {}), self.state_device

    def bind_again(self, binding: tuple) -> bool:
        """Registers the stored linears again, and allocates their state, if this model's state keeps their indices."""
        (handle, names), device = binding
        have, own_handle = (self.scaling.names, self.scaling.handle) if self.scaling else ({}, -1)
        if handle != own_handle or list(have.items()) != list(names.items())[:len(have)]:
            return False
        for name in names:
            self.scaling.register(name)
        if device is not None:
            self._allocate_state(torch.device(device))
        return True

    def _allocate_state(self, device: torch.device) -> None:
        """What the TE ops keep across calls, allocated now (a first call would put it in a CUDA graph warm-up pool)."""
        self.state_device = str(device)
        if device.type != "cuda" or self.unavailable_reason() is not None:
            return
        from transformer_engine.pytorch.cpp_extensions.gemm import get_cublas_workspace
        with torch.cuda.device(device):
            get_cublas_workspace(device.index or 0, False, False)
            if self.use_fp8:
                fwd, bwd = recipe_formats(self.recipe) if self.recipe is not None else ("e4m3", "e5m2")
                current_quantizer(fwd, False), current_quantizer(bwd)
                if self.scaling is not None:
                    self.scaling.allocate(device)

    def _matmul_as_linear(self, m: Match, notes: list) -> None:
        """`x @ W` as `linear(x, W.t().contiguous())` where TE takes it; the copy is a graph op: W gets its gradient."""
        node, graph, wv = m.root, m.root.graph, m.value("w")
        k, n = wv.shape
        with graph.inserting_before(node):
            t = add_call(graph, torch.t, (m["w"],), fake_like(wv, (n, k), stride=(1, n)))
            wt = add_call(graph, "contiguous", (t,), fake_like(wv, (n, k)))
            linear = add_call(graph, torch._C._nn.linear, (m["x"], wt), node_value(node))
        if taken := self._takes(linear, "matmul", notes):  # if not, it stays a matmul: no transposed copy for nothing
            node.replace_all_uses_with(linear)
        for unused in (node,) if taken else (linear, wt, t):
            graph.erase_node(unused)

    def _takes(self, linear: fx.Node, op: str, notes: list) -> bool:
        if reason := self._reject(linear):
            notes.append((op, f"te: {reason}; it runs as an ordinary {op}"))
        return not reason

    def _reject(self, node: fx.Node) -> str | None:
        x, w = node_value(node.args[0]), node_value(node.args[1])
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            return "linear without tensor metadata"
        if x.device.type != "cuda":
            return f"input on {x.device.type}, TE needs CUDA"
        if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
            return f"dtype {x.dtype}/{w.dtype}: TE linears take bf16 or fp16"
        if self.use_fp8:
            dims = {"M": math.prod(x.shape[:-1]), "K": x.shape[-1], "N": w.shape[0]}
            if bad := [f"{k}={v}" for k, v in dims.items() if not isinstance(v, int) or v % 16]:
                return f"fp8 needs M, K, N divisible by 16, got {', '.join(bad)}"
        return None


_IMPLEMENTATIONS = {torch.ops.pipeline_te.linear.default: _linear,
                    torch.ops.pipeline_te.linear_backward.default: _linear_backward}


def _one_op(op: fx.Node, placeholders: list[fx.Node], picked: list[int]):
    """`op`'s implementation on the region's inputs, returning the items `picked` from its result."""
    where, fn = {p: i for i, p in enumerate(placeholders)}, _IMPLEMENTATIONS[op.target]

    def run(*inputs):
        result = fn(*fx.node.map_aggregate(op.args, lambda a: inputs[where[a]] if isinstance(a, fx.Node) else a))
        return tuple(result[i] for i in picked)
    return run


def _by_weight(m: Match, specs: dict) -> bool:
    xv, wv = m.value("x"), m.value("w")
    return (getattr(specs.get(m["w"]), "kind", None) == "parameter" and isinstance(wv, torch.Tensor)
            and wv.dim() == 2 and isinstance(xv, torch.Tensor) and xv.dim() >= 2)


def _linear_name(trace: Trace, m: Match, specs: dict) -> str:
    """The linear's fp8 state name: its weight's qualified name if a parameter, else a name unique to this node."""
    w = m["w"]
    if stacked := match(STACKED, w):  # grouped linears: named after the first
        w = stacked["ws"][0]
    if transposed := match(TRANSPOSED, w):  # x @ W
        w = transposed["w"]
    return getattr(specs.get(w), "qualname", None) or f"{trace.name}.{m.root.name}"


def _extra_key(name: str, suffix: str) -> str:
    """`layers.0.wq.weight` -> `layers.0.wq._extra_state.weight_fp8_scale` (PyTorch's extra-state key)."""
    module, _, attr = name.rpartition(".")
    return f"{module}._extra_state.{attr}_{suffix}" if module else f"_extra_state.{attr}_{suffix}"


te_executor = TEExecutor()
