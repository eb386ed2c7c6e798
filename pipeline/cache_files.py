"""The cache's files, trusted only when this user wrote them (as ssh trusts `~/.ssh`): ownership and mode checks,
entries read without following links, payloads sealed with a per-user HMAC key (what and why: docs/cache.md)."""

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from typing import Optional

# the trust checks of files, shared with executors (which may not import pipeline); the cache writes its entries with write_file
from executors.artifact_files import (MAX_ENTRY_BYTES, Skipped, Untrusted, check_owned, read_file,  # noqa: F401
                                      write_file)

SECRET_NAME = "secret.key"


def private_dir(path: str, what: str = "cache directory") -> str:
    """`path` as a dir only this user writes: made 0700 (parents too) if absent, else checked. Raises `Untrusted`."""
    try:
        os.mkdir(path, 0o700)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        return private_dir(path, what)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{what} {path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
                        f"remove it, or point PIPELINE_CACHE_DIR at a directory of your own")
    check_owned(path, st, what)
    return path


def check_parents(path: str) -> None:
    """Raises `Untrusted` when a directory above `path` is writable by group or others, unless sticky (`/tmp`)."""
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        if (mode := os.stat(parent).st_mode) & 0o022 and not mode & stat.S_ISVTX:
            raise Untrusted(f"directory {parent} above the cache is writable by group or others, who could "
                            f"replace the cache in it; run `chmod go-w {parent}` or move PIPELINE_CACHE_DIR")
        if parent == os.path.dirname(parent):
            return
        parent = os.path.dirname(parent)


def secret(root: str) -> bytes:
    """This user's HMAC key, `<root>/secret.key`: 32 random bytes, made on first use (written in
    full to a temporary file, then linked into place, so a racing process reads the winner's)."""
    path = os.path.join(root, SECRET_NAME)
    for _ in range(2):
        with contextlib.suppress(FileNotFoundError):
            if len(data := read_file(path, "cache key", private=True, limit=4096)) != 32:
                raise Untrusted(f"cache key {path} is not a key this pipeline made ({len(data)} bytes); remove it")
            return data
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".key")
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
            os.close(fd)
            with contextlib.suppress(FileExistsError):  # another process made it first: then theirs is read
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    raise Untrusted(f"cache key {path} could not be made")  # pragma: no cover - removed while we ran


def seal(key: bytes, name: str, payload: bytes, magic: bytes) -> bytes:
    """`magic`, the HMAC-SHA256 of `name` and `payload` under `key` (hex), a newline, `payload`.
    The name is in the MAC, so an entry moved to another entry's path does not authenticate."""
    return magic + _mac(key, name, payload) + b"\n" + payload


def unseal(key: bytes, name: str, data: bytes, magic: bytes) -> Optional[bytes]:
    """The payload `seal` wrapped, or None when `data` is not what this key sealed under `name`."""
    if len(data) < (header := len(magic) + 64 + 1) or not data.startswith(magic) or data[header - 1:header] != b"\n":
        return None
    payload = data[header:]
    return payload if hmac.compare_digest(data[len(magic):header - 1], _mac(key, name, payload)) else None


def _mac(key: bytes, name: str, payload: bytes) -> bytes:
    mac = hmac.new(key, name.encode() + b"\0", hashlib.sha256)
    mac.update(payload)
    return mac.hexdigest().encode()
