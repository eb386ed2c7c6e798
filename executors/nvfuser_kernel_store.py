"""nvFuser's compiled kernels kept between processes, in a folder of the pipeline's cache.

`nvfuser_direct` cannot serialize a compiled fusion, so a warm start defines and schedules each fusion
again; what it can keep is NVRTC's output, most of a fusion's compile time. nvFuser's kernel database
(option `kernel_db`) maps a kernel's CUDA source and compile flags to its cubin, but as shipped it is a
shared `$TMPDIR/nvfuser_kernel_db`, read once per process, numbering new kernels by how many rows it
read, with no guard against a second writer. So here it lives in the cache's private folder (TMPDIR
points there while nvFuser compiles), one process at a time uses it (an exclusive lock held until the
process exits; another compiles without it, with a warning), and before nvFuser reads it each row must
name its own numbered files, in order, each source once; otherwise it is emptied (with a warning).
"""

import contextlib
import fcntl
import os
import re
import warnings

from ir import PipelineWarning

from .artifact_files import artifact_files_dir, cache_on
from .base import library_version

_HEADER = "kernel_signature,compile_args,kernel_code_file,cubin_file"
_ROW = re.compile(r"[\w-]+,[\w -=]+,([\w/-]+)\.cu,([\w/-]+)\.cubin", re.ASCII)  # nvFuser's own pattern
_state: dict = {}  # "folder": the TMPDIR nvFuser compiles under; "lock": its file, held; "off": why not


@contextlib.contextmanager
def compiling():
    """Around an nvFuser call that may compile: yields its keyword options (`kernel_db` on, and its
    parallel compile off: the database's reads are not guarded against its writes), or {} when the
    store is off (the pipeline's cache off, another process holding it, NVFUSER_ENABLE's own kernel_db)."""
    folder = _folder()
    if folder is None:
        yield {}
        return
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    try:
        yield {"_enable_options": ["kernel_db"], "_disable_options": ["parallel_compile"]}
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before


def status() -> str:
    """Where this process keeps nvFuser's kernels, or why it does not."""
    return f"nvFuser kernels kept in {_state['folder']}" if "folder" in _state else \
        f"nvFuser kernels not kept: {_state.get('off', 'no fusion compiled yet')}"


def _folder() -> str | None:
    if not cache_on():  # e.g. turned off for the process (an untrusted root), after kernels were kept
        return None
    if "folder" in _state or "off" in _state:
        return _state.get("folder")
    if "kernel_db" in os.environ.get("NVFUSER_ENABLE", "").split(","):
        _state["off"] = "NVFUSER_ENABLE turns nvFuser's own kernel_db on (in $TMPDIR)"
        return None
    try:
        root = artifact_files_dir("nvfuser")
        if root is None:  # the cache is off now; it may be on for a later model
            return None
        folder = os.path.join(root, re.sub(r"[^\w.=-]+", "_", library_version("nvfuser_direct")))
        os.makedirs(folder, 0o700, exist_ok=True)
        lock = open(os.path.join(folder, "lock"), "a")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        database = os.path.join(folder, "nvfuser_kernel_db")
        if (why := _inconsistent(database)) is not None:
            warnings.warn(f"nvfuser: emptied the kernel store {database}: {why}", PipelineWarning, stacklevel=4)
            _empty(database)
    except OSError as e:
        _state["off"] = f"another process holds {folder}" if isinstance(e, BlockingIOError) else \
            f"{type(e).__name__}: {e}"
        warnings.warn(f"nvfuser: {_state['off']}: this process compiles nvFuser's kernels without keeping "
                      "them", PipelineWarning, stacklevel=4)
        return None
    _state.update(folder=folder, lock=lock)
    return folder


def _empty(database: str) -> None:
    if os.path.islink(database) or not os.path.isdir(database):
        os.remove(database)
        return
    for name in os.listdir(database):
        if name.endswith((".cu", ".cubin", ".csv")):
            os.remove(os.path.join(database, name))


def _inconsistent(database: str) -> str | None:
    """Why nvFuser could pair a source with another kernel's cubin if it read `database`, or None:
    nvFuser numbers its next kernel by how many rows it read, so every row must be read, in order."""
    if not os.path.lexists(database):
        return None
    if os.path.islink(database) or not os.path.isdir(database):
        return "not a folder"
    try:
        with open(os.path.join(database, "db.csv"), "rb") as f:
            rows = f.read().decode("ascii").split("\n")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        return f"db.csv does not read ({type(e).__name__})"
    if rows and rows[-1] == "":
        rows.pop()  # the newline ending the last row
    if not rows or rows[0] != _HEADER:
        return "its db.csv has no header"
    sources = set()
    for i, row in enumerate(rows[1:]):
        match = _ROW.fullmatch(row)
        if match is None or match.groups() != (f"kernel_{i}", f"kernel_{i}"):
            return f"row {i + 1} of db.csv is not kernel_{i}'s"
        for name in (f"kernel_{i}.cu", f"kernel_{i}.cubin"):
            path = os.path.join(database, name)
            if os.path.islink(path) or not os.path.isfile(path):
                return f"{name} is not a file"
        with open(os.path.join(database, f"kernel_{i}.cu"), "rb") as f:
            source = f.read()
        if source in sources:
            return f"kernel_{i}.cu repeats an earlier kernel's source"
        sources.add(source)
    return None
