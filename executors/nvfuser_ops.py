"""How `nvfuser` writes a region as a `FusionDefinition` (docs/executors.md, "nvfuser"): `OPS` maps an ATen overload
to a translation `fn(fd, node, *args, **kwargs) -> Val`, `CLAIMS` holds the same ops with their checkers, both filled
by `@_op(*overloads, checker=...)`. Results are cast back to the trace's dtype (nvFuser computes half types in fp32)."""

import math
import operator
from typing import Optional, Sequence

import torch
import torch.fx as fx

from ir import node_value

from .claims import Checker, ClaimTable

aten, prims = torch.ops.aten, torch.ops.prims
OPS: dict = {}
CLAIMS = ClaimTable()
NO_NVFUSER_DTYPES = {torch.int8, torch.uint8, torch.int16, torch.float64, torch.complex64, torch.complex128}


def _op(*overloads, checker: Optional[Checker] = None):
    """Registers `fn` as the translation of `overloads`, each claimed when `checker` (if any) accepts the node."""
    def register(fn):
        for o in overloads:
            OPS[o] = fn
            CLAIMS.register(o, checker=checker)
        return fn
    return register


def _static_shapes(node: fx.Node) -> bool:
    v = node_value(node)
    return all(isinstance(s, int) for s in v.shape) if isinstance(v, torch.Tensor) else True


def define_fusion(FusionDefinition, gm: fx.GraphModule, inputs: Sequence):
    """The definition of region `gm` for inputs with the metadata of `inputs`, in a `FusionDefinition()`."""
    with FusionDefinition() as fd:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        env: dict[fx.Node, object] = {node: _define_input(fd, value) for node, value in zip(placeholders, inputs)}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                env[node] = _translate(fd, node, env)
            elif node.op == "output":
                for out in node.args[0]:
                    fd.add_output(env[out])
    return fd


def _define_input(fd, value):
    from nvfuser_direct import DataType, compute_tensor_descriptor

    if isinstance(value, torch.Tensor):
        shape = [1 if s == 1 else -1 for s in value.shape]
        sizes = [int(s) if isinstance(s, int) else 2 for s in value.shape]
        strides = [int(s) if isinstance(s, int) else 0 for s in value.stride()]
        contiguity, stride_order = compute_tensor_descriptor(sizes, strides)
        return fd.define_tensor(shape=shape, contiguity=contiguity, dtype=_nv(value.dtype),
                                is_cpu=value.device.type == "cpu", stride_order=stride_order)
    if isinstance(value, (int, torch.SymInt)):
        return fd.define_scalar(DataType.Int)
    if isinstance(value, float):
        return fd.define_scalar(DataType.Double)
    raise TypeError(f"nvfuser: unsupported region input {type(value).__name__}")


def _translate(fd, node: fx.Node, env):
    def arg(a):
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    if node.target is operator.getitem:
        return env[node.args[0]][node.args[1]]
    if (fn := OPS.get(node.target)) is None:
        raise NotImplementedError(f"nvfuser: no translation for {node.target}")
    args = [arg(a) for a in node.args]
    kwargs = {k: arg(v) for k, v in node.kwargs.items()}
    if node.target not in _LAYOUTOPS:  # nvFuser computes in fp32: give math ops fp32 operands
        args = [_float(fd, a) for a in args]
    result, want = fn(fd, node, *args, **kwargs), node_value(node)
    if isinstance(want, torch.Tensor) and not isinstance(result, (tuple, list)) and result.dtype() != _nv(want.dtype):
        result = fd.ops.cast(result, _nv(want.dtype))
    return result


def _nv(dtype):
    from nvfuser_direct.pytorch_utils import torch_dtype_to_nvfuser_dtype
    return torch_dtype_to_nvfuser_dtype(dtype)


def _float(fd, x):
    from nvfuser_direct import DataType
    try:
        half = x.dtype() in (DataType.Half, DataType.BFloat16)
    except (AttributeError, TypeError):
        return x
    return fd.ops.cast(x, DataType.Float) if half else x


def _rank(node: fx.Node, i: int = 0) -> int:
    return node_value(node.args[i]).dim()


def _dims(dims, rank):
    dims = [dims] if isinstance(dims, int) else list(dims or range(rank))
    return [d % rank if rank else 0 for d in dims]


_UNARY = ("abs", "neg", "exp", "log", "tanh", "sigmoid", "rsqrt", "sqrt", "erf", "cos", "sin", "reciprocal", "relu",
          "silu", "log1p", "expm1", "exp2", "logical_not", "isnan", "sign", "floor", "ceil", "round")
for _name in _UNARY:
    _op(getattr(aten, _name).default)(lambda fd, node, x, _n=_name: getattr(fd.ops, _n)(x))

_BINARY = {aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "truediv", aten.div.Scalar: "truediv",
           aten.maximum.default: "maximum", aten.minimum.default: "minimum", aten.pow.Tensor_Tensor: "pow",
           aten.pow.Scalar: "pow", aten.eq.Tensor: "eq", aten.eq.Scalar: "eq", aten.ne.Tensor: "ne",
           aten.ne.Scalar: "ne", aten.lt.Tensor: "lt", aten.lt.Scalar: "lt", aten.le.Tensor: "le",
           aten.le.Scalar: "le", aten.gt.Tensor: "gt", aten.gt.Scalar: "gt", aten.ge.Tensor: "ge",
           aten.ge.Scalar: "ge", aten.logical_and.default: "logical_and", aten.logical_or.default: "logical_or"}
for _overload, _name in _BINARY.items():
    _op(_overload)(lambda fd, node, a, b, _n=_name: getattr(fd.ops, _n)(a, b))


@_op(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
def _add_or_sub(fd, node, a, b, alpha=1):
    op = fd.ops.add if node.target in (aten.add.Tensor, aten.add.Scalar) else fd.ops.sub
    return op(a, b if alpha == 1 else fd.ops.mul(b, alpha))


_op(aten.rsub.Scalar, aten.rsub.Tensor)(
    lambda fd, node, a, b, alpha=1: fd.ops.sub(b, a if alpha == 1 else fd.ops.mul(a, alpha)))


# x ** c for the exponents norms and their gradients use, as multiplies or roots: else a general powf (tens of ops)
_POWERS = {1: lambda fd, x: fd.ops.set(x), 2: lambda fd, x: fd.ops.mul(x, x),
           3: lambda fd, x: fd.ops.mul(fd.ops.mul(x, x), x), 0.5: lambda fd, x: fd.ops.sqrt(x),
           -0.5: lambda fd, x: fd.ops.rsqrt(x), -1: lambda fd, x: fd.ops.reciprocal(x)}


@_op(aten.pow.Tensor_Scalar)
def _pow_scalar(fd, node, x, exponent):
    """Integer tensors keep `pow`, which promotes a float exponent as eager does (x*x would stay integer)."""
    special = _POWERS.get(exponent) if isinstance(exponent, (int, float)) else None
    if special is None or not node_value(node.args[0]).dtype.is_floating_point:
        return fd.ops.pow(x, exponent)
    return special(fd, x)


_op(aten.where.self)(lambda fd, node, cond, a, b: fd.ops.where(cond, a, b))


@_op(aten.clamp.default)
def _clamp(fd, node, x, min=None, max=None):
    x = x if min is None else fd.ops.maximum(x, min)
    return x if max is None else fd.ops.minimum(x, max)


def _copy_keeps_device(node: fx.Node) -> bool:
    """Whether a `_to_copy` only changes dtype/layout, on the device it started on (a checker)."""
    return (set(node.kwargs) <= {"dtype", "layout", "device", "memory_format"}
            and node_value(node).device == node_value(node.args[0]).device)


@_op(prims.convert_element_type.default)
@_op(aten._to_copy.default, checker=_copy_keeps_device)
def _to_copy(fd, node, x, dtype=None, **kwargs):
    return fd.ops.cast(x, _nv(node_value(node).dtype))


_op(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default)(lambda fd, node, x, **kwargs: fd.ops.set(x))


@_op(aten.silu_backward.default)
def _silu_backward(fd, node, grad, x):
    s = fd.ops.sigmoid(x)
    return fd.ops.mul(grad, fd.ops.mul(s, fd.ops.add(1.0, fd.ops.mul(x, fd.ops.sub(1.0, s)))))


_op(aten.sigmoid_backward.default)(lambda fd, node, grad, y: fd.ops.mul(grad, fd.ops.mul(y, fd.ops.sub(1.0, y))))
_op(aten.tanh_backward.default)(lambda fd, node, grad, y: fd.ops.mul(grad, fd.ops.sub(1.0, fd.ops.mul(y, y))))
_op(aten.threshold_backward.default)(
    lambda fd, node, grad, x, threshold: fd.ops.where(fd.ops.le(x, threshold), 0.0, grad))


@_op(aten.gelu.default)
def _gelu(fd, node, x, approximate="none"):
    if approximate == "tanh":
        inner = fd.ops.mul(0.7978845608028654, fd.ops.add(x, fd.ops.mul(0.044715, fd.ops.mul(x, fd.ops.mul(x, x)))))
        return fd.ops.mul(fd.ops.mul(0.5, x), fd.ops.add(1.0, fd.ops.tanh(inner)))
    return fd.ops.mul(fd.ops.mul(0.5, x), fd.ops.add(1.0, fd.ops.erf(fd.ops.mul(x, 0.7071067811865476))))


@_op(aten.gelu_backward.default, checker=lambda n: n.kwargs.get("approximate", "none") == "none")
def _gelu_backward(fd, node, grad, x, approximate="none"):  # the tanh approximation is not claimed
    cdf = fd.ops.mul(0.5, fd.ops.add(1.0, fd.ops.erf(fd.ops.mul(x, 0.7071067811865476))))
    pdf = fd.ops.mul(0.3989422804014327, fd.ops.exp(fd.ops.mul(-0.5, fd.ops.mul(x, x))))
    return fd.ops.mul(grad, fd.ops.add(cdf, fd.ops.mul(x, pdf)))


# nvFuser rejects a reduction over no axis: a 0-dim tensor's sum, mean, amax or amin is the tensor itself
_op(aten.sum.dim_IntList, aten.sum.default)(lambda fd, node, x, dims=None, keepdim=False, dtype=None: fd.ops.sum(
    x, _dims(dims, _rank(node)), keepdim) if _rank(node) else x)


@_op(aten.mean.default)
@_op(aten.mean.dim, checker=_static_shapes)
def _mean(fd, node, x, dims=None, keepdim=False, dtype=None):
    if not _rank(node):
        return x
    total = fd.ops.sum(x, dims := _dims(dims, _rank(node)), keepdim)
    if not isinstance(count := math.prod(node_value(node.args[0]).shape[d] for d in dims), int):
        raise NotImplementedError("nvfuser: mean over a symbolic size")
    return fd.ops.truediv(total, float(count))


@_op(aten.amax.default, aten.amin.default)
def _amax_or_amin(fd, node, x, dims=(), keepdim=False):
    reduce = fd.ops.max if node.target is aten.amax.default else fd.ops.min
    return reduce(x, _dims(dims, _rank(node)), keepdim) if _rank(node) else x


@_op(aten.var_mean.correction)
def _var_mean(fd, node, x, dims=None, *, correction=None, keepdim=False):
    var, mean = fd.ops.var_mean(x, _dims(dims, _rank(node)), int(1 if correction is None else correction), keepdim)
    want = node_value(node)
    return (fd.ops.cast(var, _nv(want[0].dtype)), fd.ops.cast(mean, _nv(want[1].dtype)))


@_op(aten._softmax.default)
def _softmax(fd, node, x, dim, half_to_float):
    dim = _dims(dim, _rank(node))
    e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, dim, True)))
    return fd.ops.truediv(e, fd.ops.sum(e, dim, True))


@_op(aten._log_softmax.default)
def _log_softmax(fd, node, x, dim, half_to_float):
    dim = _dims(dim, _rank(node))
    shifted = fd.ops.sub(x, fd.ops.max(x, dim, True))
    return fd.ops.sub(shifted, fd.ops.log(fd.ops.sum(fd.ops.exp(shifted), dim, True)))


@_op(aten._softmax_backward_data.default)
def _softmax_backward(fd, node, grad, y, dim, input_dtype):
    gy = fd.ops.mul(grad, y)
    return fd.ops.sub(gy, fd.ops.mul(y, fd.ops.sum(gy, _dims(dim, _rank(node)), True)))


@_op(aten._log_softmax_backward_data.default)
def _log_softmax_backward(fd, node, grad, y, dim, input_dtype):
    return fd.ops.sub(grad, fd.ops.mul(fd.ops.exp(y), fd.ops.sum(grad, _dims(dim, _rank(node)), True)))


_op(aten.view.default, aten._unsafe_view.default, aten.reshape.default)(
    lambda fd, node, x, shape: fd.ops.reshape(x, list(shape)))
_op(aten.permute.default)(lambda fd, node, x, dims: fd.ops.permute(x, _dims(dims, _rank(node))))
_op(aten.t.default)(lambda fd, node, x: fd.ops.permute(x, [1, 0]) if _rank(node) == 2 else x)


@_op(aten.transpose.int)
def _transpose(fd, node, x, d0, d1):
    rank = _rank(node)
    order, d0, d1 = list(range(rank)), d0 % rank, d1 % rank
    order[d0], order[d1] = order[d1], order[d0]
    return fd.ops.permute(x, order)


@_op(aten.unsqueeze.default)
def _unsqueeze(fd, node, x, dim):
    rank = _rank(node) + 1
    return fd.ops.broadcast(x, [i == dim % rank for i in range(rank)])


@_op(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(fd, node, x, dims):
    shape = node_value(node.args[0]).shape
    dims = [d for d in _dims(dims, _rank(node)) if shape[d] == 1]
    return fd.ops.squeeze(x, dims) if dims else x


@_op(aten.expand.default, checker=_static_shapes)
def _expand(fd, node, x, shape, implicit=False):
    rank_in, out = _rank(node), list(node_value(node).shape)
    if len(shape) > rank_in:
        x = fd.ops.broadcast(x, [i < len(shape) - rank_in for i in range(len(shape))])
    return fd.ops.expand(x, [int(s) if isinstance(s, int) else s for s in out])


_LAYOUTOPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
               aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
               aten.expand.default, aten.clone.default, aten.alias.default,
               aten.lift_fresh_copy.default, aten._to_copy.default, prims.convert_element_type.default}
