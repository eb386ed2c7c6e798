"""Where executors keep the files a cached artifact loads (Inductor's kernels), set by the pipeline's cache, and how
files there are read and written: only regular files this user owns, read without following links (docs/cache.md)."""

import contextlib
import os
import stat
import tempfile

MAX_ENTRY_BYTES = 1 << 30
_artifact_files_root: list[str] = []  # set by the pipeline's cache once it has checked its root


def set_artifact_files_root(path: str | None) -> None:
    """Where executors keep cached artifacts' files: a directory only this user can write, or None (cache off)."""
    _artifact_files_root[:] = [path] if path else []


def cache_on() -> bool:
    """Whether the pipeline's cache is on for what compiles now."""
    return bool(_artifact_files_root)


def artifact_files_dir(name: str) -> str | None:
    """`<root>/<name>` (0700: only this user writes there, so what was checked stays so); None when the cache is off."""
    if not _artifact_files_root:
        return None
    path = os.path.join(_artifact_files_root[0], name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a directory only you can write; remove it")
    return path


@contextlib.contextmanager
def environ_set(name: str, value: str | None):
    """`os.environ[name]` set to `value` for the duration, then restored; nothing changes when `value` is None."""
    if value is None:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def write_file(path: str, data: bytes, mode: int = 0o600) -> None:
    """Writes `path` (with `mode`) atomically: a temporary file in the same folder, then `os.replace`."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class Untrusted(Exception):
    """A cache path someone else could have written; the message names it and the fix."""


class Skipped(Exception):
    """An entry path holding what is not read (a link, FIFO, oversized or unauthentic file): recompiled and replaced."""


def check_owned(path: str, st: os.stat_result, what: str, private: bool = False) -> None:
    """Raises `Untrusted` unless `st` (of `path`) is ours, not group/other-writable (nor -readable if `private`)."""
    if st.st_uid != (uid := os.getuid()):
        raise Untrusted(f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {uid}); "
                        f"remove it, or point PIPELINE_CACHE_DIR at a directory of your own")
    if st.st_mode & (0o077 if private else 0o022):
        mode = "0600" if private else ("0700" if stat.S_ISDIR(st.st_mode) else "0600")
        raise Untrusted(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can "
                        f"{'read or write' if private else 'write'} it; run `chmod {mode} {path}`")


def read_file(path: str, what: str = "entry", *, private: bool = False, limit: int = MAX_ENTRY_BYTES) -> bytes:
    """The bytes of the regular file `path`, its size checked before it is read. Raises FileNotFoundError,
    `Skipped` (a link, not a regular file, too large) or `Untrusted` (not ours, writable by others)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        if os.path.islink(path):
            raise Skipped(f"{what} {path} is a symbolic link") from None
        raise Skipped(f"{what} {path} could not be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Skipped(f"{what} {path} is not a regular file (mode {st.st_mode:o})")
        check_owned(path, st, what, private)
        if st.st_size > limit:
            raise Skipped(f"{what} {path} is {st.st_size} bytes, over the {limit}-byte limit")
        chunks, left = [], st.st_size + 1  # one more byte: a file that grew is noticed
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
        if len(data := b"".join(chunks)) > st.st_size:
            raise Skipped(f"{what} {path} grew while it was read")
        return data
    finally:
        os.close(fd)
