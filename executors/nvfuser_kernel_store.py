"""nvFuser's compiled kernels kept between processes (docs/cache.md, "nvFuser's kernels"): its own `kernel_db`
in a folder of the pipeline's cache, through TMPDIR while it compiles, one process at a time, emptied before
nvFuser reads it unless each row names its own numbered files, in order, each source once."""

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import threading
import warnings

from ir import PipelineWarning

from .artifact_files import Skipped, Untrusted, artifact_files_dir, cache_on, environ_set, read_file
from .base import library_version

_HEADER = "kernel_signature,compile_args,kernel_code_file,cubin_file"
_ROW = re.compile(r"[\w-]+,[\w +=-]+,([\w/-]+)\.cu,([\w/-]+)\.cubin", re.ASCII)  # nvFuser's own pattern
MAX_KERNELS = 4096  # beyond, it starts again: kernel names hold their fusion's order, so other models add rows
_state: dict = {}  # "folder": the TMPDIR nvFuser compiles under; "lock": its file, held; "off": why not
_one_thread = threading.RLock()  # TMPDIR is the process's: one compile at a time swaps it


@contextlib.contextmanager
def compiling():
    """Around an nvFuser call that may compile: its options (`kernel_db` on; parallel compile off: the database's
    reads are unguarded), or {} when the store is off (no cache, another process's, NVFUSER_ENABLE's own)."""
    with _one_thread:
        if (folder := _folder()) is not None and _still_ours(folder):
            with environ_set("TMPDIR", folder):
                yield {"_enable_options": ["kernel_db"], "_disable_options": ["parallel_compile"]}
            return
    yield {}  # outside the lock: compiles without the store need not wait for each other


def status() -> str:
    """Where this process keeps nvFuser's kernels, or why it does not."""
    return f"nvFuser kernels kept in {_state['folder']}" if "folder" in _state else \
        f"nvFuser kernels not kept: {_state.get('off', 'no fusion compiled yet')}"


def _folder() -> str | None:
    if not cache_on():  # e.g. turned off for the process (an untrusted root), after kernels were kept
        return None
    if "folder" in _state or "off" in _state:
        return _state.get("folder")
    if re.search(r"\bkernel_db\b", os.environ.get("NVFUSER_ENABLE", "")):
        _state["off"] = "NVFUSER_ENABLE turns nvFuser's own kernel_db on (in $TMPDIR)"
        return None
    lock = None
    try:
        root = artifact_files_dir("nvfuser")  # not None: the cache is on
        # absolute: nvFuser keeps the path it read, and resolves a relative one after any chdir
        folder = os.path.realpath(os.path.join(root, re.sub(r"[^\w.=-]+", "_", library_version("nvfuser_direct"))))
        os.makedirs(folder, 0o700, exist_ok=True)
        lock = open(os.path.join(folder, "lock"), "a")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        database = os.path.join(folder, "nvfuser_kernel_db")
        if (why := _inconsistent(database)) is not None:
            warnings.warn(f"nvfuser: emptied the kernel store {database}: {why}", PipelineWarning, stacklevel=4)
            _empty(database)
    except OSError as e:
        if lock is not None:
            lock.close()
        _state["off"] = f"another process holds {folder}" if isinstance(e, BlockingIOError) else \
            f"{type(e).__name__}: {e}"
        warnings.warn(f"nvfuser: {_state['off']}: this process compiles nvFuser's kernels without keeping "
                      "them", PipelineWarning, stacklevel=4)
        return None
    _state.update(folder=folder, lock=lock)
    return folder


def _still_ours(folder: str) -> bool:
    """Whether the lock held is the folder's still: a folder removed and made again may be another process's."""
    with contextlib.suppress(OSError):
        return os.path.samestat(os.fstat(_state["lock"].fileno()), os.stat(os.path.join(folder, "lock")))
    return False


def _empty(database: str) -> None:
    """nvFuser makes it again when it opens its database; a link is removed, not what it names."""
    (shutil.rmtree if os.path.isdir(database) and not os.path.islink(database) else os.remove)(database)


def _inconsistent(database: str) -> str | None:
    """Why nvFuser could pair a source with another kernel's cubin (or wait) if it read `database`, or None."""
    if not os.path.lexists(database):
        return None
    if os.path.islink(database) or not os.path.isdir(database):
        return "not a folder"
    try:  # a regular file of ours, not a link (nor a FIFO, whose read would wait)
        rows = read_file(os.path.join(database, "db.csv"), "db.csv").decode("ascii").removesuffix("\n").split("\n")
    except FileNotFoundError:
        return None
    except (Skipped, Untrusted) as e:
        return str(e)
    except (OSError, UnicodeDecodeError) as e:
        return f"db.csv does not read ({type(e).__name__})"
    if not rows or rows[0] != _HEADER or len(rows) > MAX_KERNELS + 1:  # each process reads them all
        return f"its db.csv has no header, or more than {MAX_KERNELS} kernels"
    sources = set()
    for i, row in enumerate(rows[1:]):
        if (match := _ROW.fullmatch(row)) is None or match.groups() != (f"kernel_{i}", f"kernel_{i}"):
            return f"row {i + 1} of db.csv is not kernel_{i}'s"
        try:  # nvFuser does not check its writes (a full disk): each file regular, ours, not empty
            files = [read_file(os.path.join(database, f"kernel_{i}{ext}"), f"kernel_{i}{ext}") for ext in (".cu", ".cubin")]
        except (Skipped, Untrusted) as e:
            return str(e)
        except OSError as e:
            return f"kernel_{i}'s files do not read ({type(e).__name__})"
        if not all(files):
            return f"kernel_{i}'s .cu or .cubin is empty"
        if (source := hashlib.sha256(files[0]).digest()) in sources:
            return f"kernel_{i}.cu repeats an earlier kernel's source"
        sources.add(source)
    return None
