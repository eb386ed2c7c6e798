"""`Trace`: an immutable functional program over an `fx.Graph`, with input/output specs, level and provenance
(docs/design.md). Passes never edit one: they edit `trace.editable()`, a copy, and return `trace.derive(gm, by=...)`."""

import dataclasses
import enum
import hashlib
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule


class InputKind(enum.StrEnum):
    """What a graph input is. A `str`: prints as its value and equals it (`kind == "parameter"`)."""
    USER_INPUT = "user_input"
    PARAMETER = "parameter"
    BUFFER = "buffer"
    SYMINT = "symint"
    SAVED = "saved"          # backward: a value the forward kept (an activation or a forward input)
    TANGENT = "tangent"      # backward, joint: the gradient of a forward output
    SEED = "seed"            # an RNG seed, offset or generator state AOTAutograd threads through


class OutputKind(enum.StrEnum):
    """What a graph output is. A `str`, like `InputKind`."""
    USER_OUTPUT = "user_output"
    MUTATED_INPUT = "mutated_input"          # written back to the input it names
    INTERMEDIATE_BASE = "intermediate_base"  # the base of an output that is a view
    SAVED = "saved"                          # forward: kept for the backward
    GRAD = "grad"                            # backward: the gradient of the input it names
    FORWARD_OUTPUT = "forward_output"        # joint: an output of its forward part


class Stage(enum.StrEnum):
    """Which program of the pipeline a trace is: the captured graph, the joint graph, or a partition."""
    CAPTURED = "captured"
    JOINT = "joint"
    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


@dataclasses.dataclass(frozen=True)
class InputSpec:
    kind: InputKind
    name: str                       # placeholder name in the graph
    qualname: Optional[str] = None  # "layers.0.attn.wq.weight" for parameters and buffers

    def __post_init__(self):
        object.__setattr__(self, "kind", InputKind(self.kind))


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """What a graph output is (`OutputKind`); `target`: the input a mutation is written to, or a gradient is for."""
    kind: OutputKind
    target: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "kind", OutputKind(self.kind))


@dataclasses.dataclass(frozen=True)
class Step:
    """One entry of provenance: the stage or pass that made a trace and how long it took."""
    name: str
    seconds: float = 0.0


class Trace:
    """An immutable program: graph module, input/output specs, provenance, `stage` (None: made outside the pipeline)."""

    __slots__ = ("_gm", "name", "level", "stage", "inputs", "outputs", "provenance")

    def __init__(self, gm: fx.GraphModule, *, name: str, level: str, inputs: Sequence[InputSpec],
                 outputs: Sequence[OutputSpec], provenance: Sequence[Step] = (), stage: Optional[Stage] = None):
        if level not in ("torch", "aten"):
            raise ValueError(f"Trace level must be 'torch' or 'aten', got {level!r}")
        if stage is not None and stage not in tuple(Stage):
            raise ValueError(f"Trace stage must be one of {[s.value for s in Stage]} or None, got {stage!r}")
        self._gm, self.name, self.level = gm, name, level
        self.stage = None if stage is None else Stage(stage)
        self.inputs, self.outputs, self.provenance = tuple(inputs), tuple(outputs), tuple(provenance)

    @property
    def graph(self) -> fx.Graph:
        """The graph, for reading. Use `editable()` to change a copy."""
        return self._gm.graph

    @property
    def module(self) -> fx.GraphModule:
        """The graph module (holds constants and submodules), for reading and running."""
        return self._gm

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def output_values(self) -> list[Any]:
        out = self.output_node().args[0]
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def ops(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op in ("call_function", "call_method", "call_module")]

    def fingerprint(self) -> str:
        """A hash of the program text; equal fingerprints mean the same program."""
        from .printer import python_source
        return hashlib.sha256(python_source(self).encode()).hexdigest()[:16]

    def editable(self) -> fx.GraphModule:
        """A private copy of the graph module for a pass to edit: nodes copied with metadata (fake tensors shared, never
        mutated), constants and submodules shared; code made when first run or printed (edits would make it stale)."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.graph, {})).meta = dict(self.output_node().meta)
        return _LazyGraphModule(self._gm, graph, class_name=type(self._gm).__name__)

    def derive(self, gm: fx.GraphModule, *, by: str, seconds: float = 0.0, name: Optional[str] = None,
               level: Optional[str] = None, inputs: Optional[Sequence[InputSpec]] = None,
               outputs: Optional[Sequence[OutputSpec]] = None) -> "Trace":
        """A new trace made from this one by the stage or pass `by` (of the same `stage`)."""
        inputs, outputs = self.inputs if inputs is None else inputs, self.outputs if outputs is None else outputs
        return Trace(gm, name=name or self.name, level=level or self.level, stage=self.stage, inputs=inputs,
                     outputs=outputs, provenance=self.provenance + (Step(by, seconds),))

    def __call__(self, *args):
        from .interpret import interpret
        return interpret(self, *args)

    def __str__(self) -> str:
        from .printer import python_source
        return python_source(self)

    def __repr__(self) -> str:
        made_by = " → ".join(s.name for s in self.provenance) or "-"
        stage = f" stage={self.stage}" if self.stage is not None else ""
        return f"<Trace {self.name!r} level={self.level}{stage} ops={len(self.ops())} made by: {made_by}>"


def node_value(node: fx.Node) -> Any:
    """The fake value (tensor, tuple of tensors, SymInt) a node produces, or None if unknown."""
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def is_random(node: fx.Node) -> bool:
    """Whether the node's op draws random numbers: recomputing or reordering it changes the draws."""
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def output_ancestors(gm: fx.GraphModule, count: int) -> set[fx.Node]:
    """The nodes the first `count` outputs of `gm` depend on (of a joint graph: its forward)."""
    stack = [a for a in gm.graph.output_node().args[0][:count] if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    while stack:
        if (node := stack.pop()) not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def fake_like(like: torch.Tensor, shape, *, stride=None, dtype=None, device=None) -> torch.Tensor:
    """The metadata a pass sets on a node it creates: an empty tensor of `shape` (and `stride`) in the fake
    mode of `like` (a meta tensor when it is not fake), with `like`'s dtype and device unless given."""
    dtype, device = like.dtype if dtype is None else dtype, like.device if device is None else device
    if (mode := getattr(like, "fake_mode", None)) is None:
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    with mode:
        if stride is None:
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=device)


def describe_value(v: Any) -> str:
    """`f32[8, 16]` for a tensor, a tuple of those for tuples, the type otherwise."""
    if isinstance(v, torch.Tensor):
        shape, dev = ", ".join(str(s) for s in v.shape), "" if v.device.type == "cpu" else f" {v.device}"
        return f"{_DTYPE_ABBREV.get(v.dtype, str(v.dtype).replace('torch.', ''))}[{shape}]{dev}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(describe_value(x) for x in v) + ")"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(v).__name__} {v}"
    return "None" if v is None else type(v).__name__


_DTYPE_ABBREV = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "b8", torch.complex64: "c64", torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2"}
