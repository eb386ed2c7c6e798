"""The on-disk cache of compiled artifacts, an entry per captured graph (key, contents, trust model: docs/cache.md). A
hit captures, then loads instead of lowering (`warm_start`) or compiling; only entries this user sealed are read."""

import atexit
import functools
import hashlib
import inspect
import os
import pathlib
import pickle
import stat
import sys
import time
import warnings
from typing import Optional

import torch

from executors.artifact_files import set_artifact_files_root
from executors.plan import RegionArtifact
from executors.region_keys import tensor_digest, value_signature
from ir import PipelineWarning, get_logger

from . import cache_files

FORMAT = 2
MAGIC = b"fxpipeline-cache 2 hmac-sha256\n"
OWN_PACKAGES = ("torch", "ir.", "executors.", "pipeline.", "transforms.", "builtins", "_operator", "math")
PLAIN = (type(None), bool, int, float, str, bytes)  # values a key holds as they are
TORCH_NAMESPACES = {"aten", "prims", "higher_order", "_c10d_functional", "c10d", "_dtensor", "pipeline", "pipeline_te"}
log = get_logger("cache")


class Uncacheable(Exception):
    """This graph cannot be cached; the message says why."""


def uncached(pass_or_fn):
    """Marks a pass (or its function) uncacheable: graphs it runs on always compile. `@trace_pass` then `@uncached`."""
    object.__setattr__(pass_or_fn, "cacheable", False)
    return pass_or_fn


def cache_root() -> str:
    """`PIPELINE_CACHE_DIR`, or `fxpipeline` under the user's cache dir (`$XDG_CACHE_HOME`, ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("PIPELINE_CACHE_DIR") or os.path.join(base, "fxpipeline")


def disabled_reason(option: bool) -> Optional[str]:
    if not option:
        return "jit(..., cache=False)"
    return "PIPELINE_CACHE=0" if os.environ.get("PIPELINE_CACHE", "1").lower() in ("0", "false", "off", "no") else None


# -- the key --------------------------------------------------------------------------------------
def graph_key(gm, example_inputs, state) -> str:
    """The hash naming a captured graph's entry; raises `Uncacheable`."""
    parts = [f"format {FORMAT}", f"torch {torch.__version__}", f"python {sys.version}", f"pipeline {pipeline_source_hash()}",
             f"modes {global_modes()}", *graph_code(gm), f"aot_autograd {lowering_config()}"]
    parts += [value_signature(v) for v in example_inputs]
    parts += [f"owner {state.config.owners.get(id(v))}" for v in example_inputs]
    parts += [pass_identity(p) for p in state.config.passes]
    parts += [f"executor {e.name} {e.cache_token()}" for e in state.config.executors]
    for qualname, r in sorted(state.config.replaced.items()):
        parts.append(f"replaced {qualname} {stable_repr(r.transform)} "
                     f"{[(s, value_signature(t)) for s, t in r.tensors.items()]}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def graph_code(gm) -> list[str]:
    """The code of the captured graph, and of what it only names: the bodies of its higher-order ops (checkpoint, cond),
    the functions and custom ops it calls (`torch._dynamo.allow_in_graph`, `torch.library.custom_op`)."""
    for name, sub in gm.named_modules():
        if not isinstance(sub, torch.fx.GraphModule):
            raise Uncacheable(f"the captured graph holds a {type(sub).__qualname__} ({name}) whose code is not a graph")
    called = {n.target for _, sub in gm.named_modules() for n in sub.graph.nodes if n.op == "call_function"}
    return [f"graph {name}\n{sub.graph.python_code(root_module='self').src}" for name, sub in gm.named_modules()] + \
        sorted(_callee_identity(t) for t in called)


def _callee_identity(target) -> str:
    from torch._library.custom_ops import OPDEFS
    if isinstance(target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        qualname = getattr(target, "_qualified_op_name", None) or target._schema.name
        if qualname.split("::")[0] in TORCH_NAMESPACES:
            return ""
        if (opdef := OPDEFS.get(qualname)) is None:
            raise Uncacheable(f"the graph calls custom op {qualname}, whose kernels' code the key cannot read (define "
                              f"it with torch.library.custom_op)")
        kernels = [dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__ or ()))).get("fn", f)
                   for f in map(inspect.unwrap, opdef._backend_fns.values())]  # torch wraps each kernel registered
        fns = [opdef._init_fn, opdef._abstract_fn, opdef._setup_context_fn, opdef._backward_fn, *kernels]
        return f"op {qualname} {stable_repr(fns, qualname)}"
    if inspect.isfunction(target) and not (target.__module__ or "").startswith(OWN_PACKAGES):
        return f"calls {function_identity(target, target.__qualname__)}"
    return ""


def global_modes() -> tuple:
    """The global state AOTAutograd lowers under (a tuple: `GradCapture` keys every call on it): grad and inference
    mode (an inference graph or a forward + backward), deterministic algorithms, autocast, the default dtype (of
    factory ops without one), the matmul precision flags. A warm start loads the lowering, so all of it is in the key."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.are_deterministic_algorithms_enabled(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
            torch.get_default_dtype(), torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32)


def lowering_config() -> str:
    """AOTAutograd's config but its cache's switches (which `warm_start` sets): `donated_buffer` alone decides
    whether a backward may overwrite its saved tensors, which a second `backward(retain_graph=True)` reads again."""
    from torch._functorch import config
    text = repr(sorted((k, v) for k, v in config.save_config_portable().items() if "autograd_cache" not in k
                       and k not in ("force_non_lazy_backward_lowering", "bypass_autograd_cache_key")))
    if " at 0x" in text:
        raise Uncacheable("torch._functorch.config holds an object with no stable identity (a custom pass?)")
    return text


@functools.cache
def pipeline_source_hash() -> str:
    """SHA-256 over the source files of the pipeline's packages, read once per process."""
    root, digest = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), hashlib.sha256()
    for package in ("ir", "executors", "pipeline", "transforms"):
        for path in sorted(pathlib.Path(root, package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def pass_identity(p) -> str:
    """A pass's qualified name, where it runs, and a hash of its source and closure."""
    if getattr(p, "cacheable", True) is False or getattr(p.fn, "cacheable", True) is False:
        raise Uncacheable(f"pass {p.name!r} opts out of caching")
    return f"pass {p.name} {p.runs_on} {function_identity(p.fn, p.name)}"


def function_identity(fn, name: str, depth: int = 0) -> str:
    target = getattr(fn, "__func__", fn)
    if not inspect.isfunction(target):  # a callable object: its class's __call__ and its fields
        if not inspect.isfunction(call := getattr(type(fn), "__call__", None)):
            raise Uncacheable(f"pass {name!r}: cannot read the source of {fn!r}")
        return f"{function_identity(call, name, depth + 1)} {stable_repr(vars(fn), name, depth + 1)}"
    cells = [c.cell_contents for c in (target.__closure__ or ()) if _cell_filled(c)]
    owner = fn.__self__ if inspect.ismethod(fn) and not inspect.isclass(fn.__self__) else None
    fields = stable_repr(vars(owner), name, depth + 1) if hasattr(owner, "__dict__") else ""  # a bound method's
    return (f"{target.__module__}.{target.__qualname__} {_source_digest(target, name)} {fields} "
            f"{stable_repr(cells, name, depth + 1)} {stable_repr(target.__defaults__, name, depth + 1)} "
            f"{_globals_read(target, name)}")


def _source_digest(fn, name: str) -> str:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError) as e:
        raise Uncacheable(f"pass {name!r}: the source of {fn.__qualname__} cannot be read ({e})") from None


def _globals_read(fn, name: str) -> str:
    """The module-level functions `fn` calls, and those they call (their source: an edited helper changes the key), and
    the plain values they read; pipeline and torch code is in the key by its version."""
    seen, todo, parts = {fn}, [fn], []
    while todo:
        codes, names, f = [todo[-1].__code__], set(), todo.pop()
        while codes:
            names.update((code := codes.pop()).co_names)
            codes += [c for c in code.co_consts if inspect.iscode(c)]
        for n, v in ((n, f.__globals__[n]) for n in sorted(names) if n in f.__globals__):
            if isinstance(v, PLAIN):
                parts.append(f"{n}={v!r}")
            elif inspect.isfunction(v) and v not in seen and not (v.__module__ or "").startswith(OWN_PACKAGES):
                seen.add(v)
                todo.append(v)
                parts.append(f"{v.__module__}.{v.__qualname__} {_source_digest(v, name)}")
    return " ".join(parts)


def stable_repr(value, name: str = "?", depth: int = 0) -> str:
    """The same text for `value` in every process; raises `Uncacheable` if there is none (a repr with an address)."""
    if depth > 6:
        raise Uncacheable(f"pass {name!r}: its closure is nested too deep to hash")
    if isinstance(value, (*PLAIN, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return f"{type(value).__name__}({', '.join(stable_repr(v, name, depth + 1) for v in items)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {stable_repr(v, name, depth + 1)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, torch.Tensor):
        small = value.device.type != "meta" and value.numel() <= 1 << 16
        return value_signature(value) + " " + (tensor_digest(value) if small else "(values not hashed)")
    if inspect.isfunction(value) or inspect.ismethod(value):
        return function_identity(value, name, depth + 1)
    if hasattr(value, "fn") and hasattr(value, "runs_on"):  # a TracePass
        return pass_identity(value)
    if inspect.ismodule(value) or inspect.isclass(value) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value.__name__)}"
    if hasattr(value, "__dict__"):
        return f"{type(value).__qualname__}({stable_repr(vars(value), name, depth + 1)})"
    if " at 0x" in (text := repr(value)):
        raise Uncacheable(f"pass {name!r}: {type(value).__name__} in its closure has no stable identity")
    return text


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


# -- entries on disk ------------------------------------------------------------------------------
_roots: dict[str, object] = {}  # cache root -> its HMAC key (bytes), or why it is not trusted (str)


def trusted_key(root: str) -> bytes:
    """The HMAC key of the cache at `root`, checked once a process (cache_files); raises `Untrusted` after `refuse`."""
    if root not in _roots:
        try:
            cache_files.check_parents(root)
            hmac_key = cache_files.secret(cache_files.private_dir(root, "cache root"))
            set_artifact_files_root(cache_files.private_dir(os.path.join(root, "executors")))
            _roots[root] = hmac_key
        except cache_files.Untrusted as e:
            refuse(root, str(e))
        except OSError as e:  # cannot make the root (a read-only home, say): off, said once
            refuse(root, f"cache root {root} cannot be used ({type(e).__name__}: {e})")
    if isinstance(_roots[root], str):
        raise cache_files.Untrusted(_roots[root])
    return _roots[root]


def refuse(root: str, why: str) -> None:
    """Turns the cache at `root` off for this process, with one warning saying why and how to fix it."""
    if isinstance(_roots.get(root), str):
        return
    _roots[root] = why
    set_artifact_files_root(None)
    warnings.warn(f"pipeline cache: off for this process: {why}", PipelineWarning, stacklevel=2)


def entry_path(key: str, root: Optional[str] = None) -> str:
    return os.path.join(root or cache_root(), key[:2], f"{key}.entry")


def read_entry(key: str) -> Optional[dict]:
    """The entry stored under `key`, or None (absent; or unreadable, unauthentic or stale: one warning, then replaced).
    Raises `Untrusted` when a path in the way is not this user's alone (then the caller turns the cache off)."""
    secret, path = trusted_key(cache_root()), entry_path(key)
    try:
        folder = os.lstat(os.path.dirname(path))
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(folder.st_mode):
        raise cache_files.Untrusted(f"cache directory {os.path.dirname(path)} is not a directory; remove it")
    cache_files.check_owned(os.path.dirname(path), folder, "cache directory")
    try:
        payload = cache_files.unseal(secret, key, cache_files.read_file(path), MAGIC)
    except FileNotFoundError:
        return None
    except cache_files.Skipped as e:
        warnings.warn(f"pipeline cache: {e}: not read; recompiling and replacing it", PipelineWarning)
        return None
    if payload is None:
        warnings.warn(f"pipeline cache: entry {path} is not authentic (HMAC mismatch: corrupt, truncated, "
                      f"or not written by you); not read; recompiling and replacing it", PipelineWarning)
        return None
    try:
        entry = pickle.loads(payload)  # authentic: written by this user's pipeline
    except Exception as e:  # the right bytes that no longer unpickle (e.g. a renamed class)
        warnings.warn(f"pipeline cache: entry {path} could not be read ({type(e).__name__}: {e}); recompiling",
                      PipelineWarning)
        return None
    return entry if isinstance(entry, dict) and entry.get("format") == FORMAT else None


def write_entry(key: str, entry: dict, root: Optional[str] = None) -> None:
    root = root or cache_root()
    secret, path = trusted_key(root), entry_path(key, root)
    cache_files.private_dir(os.path.dirname(path))
    cache_files.write_file(path, cache_files.seal(secret, key, pickle.dumps(entry, pickle.HIGHEST_PROTOCOL), MAGIC))


# -- one graph's entry while it compiles ----------------------------------------------------------
_changed: set = set()  # entries autotune added a choice to after they were written


def save_changed() -> None:
    """Writes the entries autotune's choices went into since written (at each jitted call, and at exit)."""
    while _changed:
        _changed.pop()._save()


atexit.register(save_changed)


class GraphCache:
    """One captured graph's entry while it compiles: region artifacts for dispatch to load and fill, what each stage
    made. `record.cache` says "hit" (every region loaded), "miss" or "off: <why>"; time: `record.seconds["cache"]`."""

    def __init__(self, key: str, record, stored: Optional[dict]):
        self.key, self.record, self.stored, self.root = key, record, stored, cache_root()
        self.entry = {"format": FORMAT, "stages": {}, "wrappers": None,
                      "artifacts": dict(stored["artifacts"]) if stored else {}}
        self.wrapped = False  # the wrappers are known: the entry is complete, and written
        record.cache = "hit" if stored else "miss"
        log.info("%s: cache %s (entry %s)", record.graph_id, record.cache, key[:16])

    @classmethod
    def open(cls, gm, example_inputs, state, record) -> Optional["GraphCache"]:
        start = time.perf_counter()
        try:
            if (reason := disabled_reason(state.config.cache)) is None:
                try:
                    trusted_key(cache_root())
                    key = graph_key(gm, example_inputs, state)
                    return cls(key, record, read_entry(key))
                except cache_files.Untrusted as e:
                    refuse(cache_root(), str(e))
                    reason = f"untrusted: {e}"
                except Uncacheable as e:
                    reason = str(e)
                except Exception as e:  # the cache must never stop a compile
                    reason = f"no key ({type(e).__name__}: {e})"
            record.cache = f"off: {reason}"
            log.info("%s: cache off: %s", record.graph_id, reason)
            return None
        finally:
            record.seconds["cache"] += time.perf_counter() - start

    @property
    def artifacts(self) -> dict[str, RegionArtifact]:
        return self.entry["artifacts"]

    def wrappers_done(self, metadata: list) -> None:
        """Notes the wrappers' metadata (known once eager stages are compiled; differing: a miss); writes the entry."""
        if self.stored is not None and self.stored.get("wrappers") not in (None, metadata):
            self._miss("runtime wrappers differ from the cached ones")
        self.entry["wrappers"] = metadata
        self.wrapped = True
        self._save()

    def aot_entry_done(self, data: bytes, seconds: float) -> None:
        """AOTAutograd's entry for this graph (`warm_start`): a warm start loads it instead of lowering."""
        self.entry["aot"] = data
        self.record.seconds["cache"] += seconds

    def stage_done(self, stage: str, lowered_fingerprint: str, execution, executed) -> None:
        """After a stage's dispatch: checked against the stored entry; rewritten when after the wrappers (lazily)."""
        start = time.perf_counter()
        before = (self.stored or {}).get("stages", {}).get(stage)
        if before is not None and before["lowered"] != lowered_fingerprint:
            self._miss(f"the lowered {stage} trace differs from the cached one")
        elif len(execution.loaded) < len(execution.regions):
            self._miss(f"{len(execution.regions) - len(execution.loaded)} {stage} region(s) compiled")
        self.record.cache_notes += execution.uncached
        self.entry["stages"][stage] = {"lowered": lowered_fingerprint, "regions": list(execution.regions)}
        self.record.seconds["cache"] += time.perf_counter() - start
        if self.wrapped:
            self._save()

    def changed(self) -> None:
        """A raced region's choice went into `artifacts`: written by `save_changed` (or the first write)."""
        if self.wrapped:
            _changed.add(self)

    def _miss(self, why: str) -> None:
        self.record.cache = "miss"
        self.record.cache_notes.append(why)
        log.info("%s: cache miss: %s", self.record.graph_id, why)

    def _save(self) -> None:
        if self.record.cache == "hit" and all(s in self.stored["stages"] for s in self.entry["stages"]):
            return  # nothing new to write
        start = time.perf_counter()
        try:
            write_entry(self.key, self.entry, self.root)  # where it was read: a choice may come later
            log.info("%s: cache entry %s stored (%s)", self.record.graph_id, self.key[:16],
                     ", ".join(self.entry["stages"]))
        except cache_files.Untrusted as e:
            refuse(cache_root(), str(e))
            self.record.cache_notes.append(f"entry not written: {e}")
        except Exception as e:  # a full disk or a read-only cache dir: compile on, uncached
            self.record.cache_notes.append(f"entry not written: {type(e).__name__}: {e}")
        self.record.seconds["cache"] += time.perf_counter() - start
