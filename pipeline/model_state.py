"""Model transforms on a jitted module: parameters replaced, the trace rewrite reading their tensors, state dicts."""

import dataclasses
import functools
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ir import InputKind, InputSpec, PipelineWarning, Trace, node_value
from transforms.chain import for_parameter
from transforms.materialize import casts_message, lacks_message
from transforms.model_transform import ModelTransform


@dataclasses.dataclass
class Replaced:
    transform: ModelTransform
    tensors: dict[str, torch.nn.Parameter]   # suffix -> the tensor the compiled code runs on
    original: torch.Tensor                    # a meta tensor with the original's shape and dtype
    module_prefix: str
    attr: str

    def extra_keys(self) -> dict[str, str]:
        """suffix -> state-dict key of transform-owned state."""
        base = f"{self.module_prefix}._extra_state" if self.module_prefix else "_extra_state"
        return {s: f"{base}.{self.attr}_{s}" for s in self.transform.extra}


def apply(model: torch.nn.Module, transforms: list[ModelTransform], reader=None,
          device: torch.device | None = None) -> dict[str, Replaced]:
    """Replaces the parameters the transforms claim (chained where several do) by stand-ins of their shape, dtype and
    device, so the module still captures (all checked first); `reader`: open safetensors, read by `encode_slices`."""
    claimed = _claimed(model, transforms)
    if reader is not None:
        keys = set(reader.keys())
        if missing := [q for q in claimed if q not in keys]:
            raise KeyError(lacks_message("the checkpoint", missing, keys))
    replaced, casts = {}, []
    for qualname, (module_prefix, module, attr, param, transform) in claimed.items():
        target = device if param.is_meta else param.device
        if reader is not None:
            source = _ReadAs(reader.get_slice(qualname), param.dtype)
            encoded = transform.encode_slices(source, param)
            if source.stored is not None:
                casts.append((qualname, source.stored, param.dtype))
        elif param.is_meta:
            raise ValueError(f"{transform.name}: {qualname} is on the meta device; materialize it first")
        else:
            encoded = transform.encode(param.detach())
        trains = transform.trainable and param.requires_grad  # a frozen parameter stays frozen
        tensors = {s: torch.nn.Parameter(t.to(target), requires_grad=trains and t.is_floating_point())
                   for s, t in encoded.items()}
        replaced[qualname] = Replaced(transform, tensors, torch.empty_like(param, device="meta"), module_prefix, attr)
        stand_in = torch.zeros(1, dtype=param.dtype, device=target).expand(param.shape)
        setattr(module, attr, stand_in := torch.nn.Parameter(stand_in, requires_grad=False))
        # `jit` refuses a model holding either, and so does an optimizer's step (`_refuse_stale_optimizer`)
        stand_in.pipeline_replaced_by = param.pipeline_replaced_by = transform.name
    if replaced:
        _check_optimizers()
        for module in {id(c[1]): c[1] for c in claimed.values()}.values():
            module.register_forward_pre_hook(_refuse_stand_ins)
    if casts:
        warnings.warn(f"materialize: loading the checkpoint: {casts_message(casts)}", PipelineWarning, stacklevel=2)
    return replaced


@functools.cache
def _check_optimizers():
    return register_optimizer_step_pre_hook(_refuse_stale_optimizer)


def _refuse_stand_ins(module, args) -> None:
    """The original module, called outside the jitted model, would compute with its stand-ins (zeros), silently."""
    if not torch.compiler.is_compiling():
        raise RuntimeError(f"this {type(module).__name__}'s parameters were replaced by a model transform and live in "
                           f"the jitted model: call that (cm(...)), or jit a fresh copy of the original")


def _refuse_stale_optimizer(optimizer, args, kwargs) -> None:
    """An optimizer over parameters a model transform replaced (built before `jit`, or from the model's stand-ins
    after it) steps tensors the compiled code never reads: what they stood for would silently not train."""
    if stale := {p.pipeline_replaced_by for g in optimizer.param_groups for p in g["params"]
                 if hasattr(p, "pipeline_replaced_by")}:
        raise RuntimeError(f"{type(optimizer).__name__} holds parameters that {', '.join(sorted(stale))} replaced, "
                           f"which nothing trains: build it after jit from cm.parameters() (a parent module's "
                           f"parameters() does not reach them: add them)")


def _claimed(model: torch.nn.Module, transforms: list[ModelTransform]) -> dict:
    """qualname -> (module prefix, module, attribute, parameter, transform) of each parameter a transform replaces."""
    claimed, refused, names = {}, [], {}
    for qualname, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(qualname)
    for module_prefix, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            qualname = f"{module_prefix}.{attr}" if module_prefix else attr
            if qualname in claimed or (transform := for_parameter(transforms, module, qualname, param)) is None:
                continue
            if (why := transform.refuses(module, param)) is not None:
                refused.append((transform, f"{qualname} ({why})"))
            if len(shared := names[id(param)]) > 1:
                raise ValueError(f"{transform.name}: {', '.join(shared)} are one parameter (tied weights or a shared "
                                 f"submodule), which it would untie: untie them or leave them out of {transform.name}")
            claimed[qualname] = (module_prefix, module, attr, param, transform)
    used = {id(p) for *_, transform in claimed.values() for p in transform.parts()}
    if idle := [p for t in transforms for p in t.parts() if id(p) not in used]:
        raise ValueError(f"{idle[0].name} applies to no parameter of {type(model).__name__} (it changes "
                         f"{idle[0].targets}), so it would change nothing: "
                         f"leave it out of transforms=[...], or jit the module whose parameters it should change")
    if refused:
        names = [r for _, r in refused]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(f"{refused[0][0].name} replaces these parameters with frozen tensors, so training would "
                         f"update only the others: {shown}. It is for inference: call model.eval() "
                         f"(and model.requires_grad_(False) if nothing should train) before pipeline.jit.")
    return claimed


class _ReadAs:
    """A safetensors slice whose reads come back in `dtype`; `stored` is the file's dtype if it differs."""

    def __init__(self, inner, dtype: torch.dtype):
        self.inner, self.dtype, self.stored = inner, dtype, None

    def __getitem__(self, index):
        if (value := self.inner[index]).dtype != self.dtype:
            self.stored = value.dtype
        return value.to(self.dtype)


def rewrite(trace: Trace, example_inputs: list, replaced: dict[str, Replaced]):
    """The trace reading the new tensors and ops rebuilding each replaced parameter; returns (trace, example inputs)."""
    graph = (gm := trace.editable()).graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fake_mode = next((node_value(n).fake_mode for n in placeholders if hasattr(node_value(n), "fake_mode")), None)
    specs, inputs, rebuild = [], [], []
    for node, spec, value in zip(placeholders, trace.inputs, example_inputs):
        if (r := replaced.get(spec.qualname) if spec.kind == InputKind.PARAMETER else None) is None:
            specs.append(spec)
            inputs.append(value)
            continue
        new = {}
        with graph.inserting_before(node):
            for suffix, tensor in r.tensors.items():
                p = graph.placeholder(f"{node.name}_{suffix.replace('.', '_')}")
                fake = fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode is not None else tensor
                p.meta["val"] = p.meta["example_value"] = fake
                new[suffix] = p
                specs.append(InputSpec(InputKind.PARAMETER, p.name, f"{spec.qualname}.{suffix}"))
                inputs.append(fake)  # static: lowering must not give these sizes symbols
        rebuild.append((node, r, new))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node, r, new in rebuild:  # right before the first use: a gathered parameter lives only while used
        first_use = min(node.users, key=order.__getitem__, default=None) or next(
            n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first_use):
            value = r.transform.rebuild(graph, new, node_value(node))
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    gm.recompile()
    names = "+".join(sorted({r.transform.name for _, r, _ in rebuild}))
    return trace.derive(gm, by=names or "model_transforms", inputs=specs), inputs


def state_dict(original_state: dict, replaced: dict[str, Replaced], executors=()) -> dict:
    """The original model's state dict, replaced parameters decoded; transforms' and executors' under `_extra_state`."""
    out = dict(original_state)
    for qualname, r in replaced.items():
        if qualname in out:
            out[qualname] = r.transform.decode(r.tensors, r.original).to(r.original.dtype)
            extra = r.transform.extra_state(r.tensors, r.original)
            out.update((key, extra[suffix].detach().clone()) for suffix, key in r.extra_keys().items())
    for executor in executors:
        out.update(executor.extra_state())
    return out


def check_shape(where: str, qualname: str, shape, r: Replaced) -> None:
    """A loaded value must have its parameter's full shape, as torch.nn.Module's loads check: `copy_` would broadcast."""
    if tuple(shape) != tuple(r.original.shape):
        raise RuntimeError(f"{where}: size mismatch for {qualname}: copying a param with shape {tuple(shape)}, "
                           f"the shape in current model is {tuple(r.original.shape)}")


def load_state_dict(model: torch.nn.Module, state: dict, replaced: dict[str, Replaced], strict: bool):
    """Loads `state` (original keys) into the transformed parameters and the rest of the model."""
    rest = dict(state)
    for qualname, r in replaced.items():
        extra = {s: rest.pop(k) for s, k in r.extra_keys().items() if k in rest}
        if qualname not in rest:
            continue
        check_shape("load_state_dict", qualname, rest[qualname].shape, r)
        encoded = r.transform.encode(rest.pop(qualname).to(r.tensors[next(iter(r.tensors))].device), extra or None)
        with torch.no_grad():
            for suffix, tensor in encoded.items():
                r.tensors[suffix].copy_(tensor)
    result = model.load_state_dict(rest, strict=False)
    missing = [k for k in result.missing_keys if k not in replaced] + [q for q in replaced if q not in state]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {result.unexpected_keys}")
    return torch.nn.modules.module._IncompatibleKeys(missing, result.unexpected_keys)
