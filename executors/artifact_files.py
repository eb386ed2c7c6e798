"""Where executors keep the files a cached artifact loads (Inductor's kernels); set by the pipeline's cache."""

import contextlib
import os
import stat
import tempfile

_artifact_files_root: list[str] = []  # set by the pipeline's cache once it has checked its root


def set_artifact_files_root(path: str | None) -> None:
    """Where executors keep the files of cached artifacts: a directory only this user can write
    (the pipeline's cache checks it and calls this), or None while the cache is off."""
    _artifact_files_root[:] = [path] if path else []


def cache_on() -> bool:
    """Whether the pipeline's cache is on for what compiles now."""
    return bool(_artifact_files_root)


def artifact_files_dir(name: str) -> str | None:
    """`<root>/<name>` (made 0700) for an executor's files that a cached artifact loads (Inductor's
    kernels): only this user can write there, so what was checked before loading stays as checked.
    None while the cache is off; then an executor uses its library's own directories."""
    if not _artifact_files_root:
        return None
    path = os.path.join(_artifact_files_root[0], name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} is not a directory only you can write; remove it")
    return path


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
