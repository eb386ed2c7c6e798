"""The compiled-artifact cache trusts only what this user wrote: nothing another key sealed is
unpickled, an artifact runs only for the region graph it came from, links, FIFOs and giant files are
never read, a cache someone else could write turns the cache off (one warning naming path and fix),
and its key is the same in every fresh process."""
import glob
import os
import pickle
import secrets
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch._dynamo

import pipeline
from executors import Executor
from ir import PipelineWarning
from pipeline import cache, cache_files
from test_cache import ROOT, compile_and_step, entries


def cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PipelineWarning)
            and "pipeline cache" in str(w.message)]


def compiled_twice(model, x, **kwargs):
    """Compiles `model` twice, recording the cache warnings of the second compile."""
    compile_and_step(model, x, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm, out, _ = compile_and_step(model, x, **kwargs)
    return cm, out, cache_warnings(caught)


class Planted:
    """What another user would plant: unpickling it writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_entry_sealed_with_another_key_is_never_unpickled(mlp, tmp_path):
    x = torch.randn(4, 16)
    _, out0, _ = compile_and_step(mlp, x)
    [path] = entries()
    key = os.path.basename(path)[: -len(".entry")]
    marker = tmp_path / "planted-code-ran"
    payload = pickle.dumps({"format": cache.FORMAT, "artifacts": {}, "stages": {}, "x": Planted(str(marker))})
    with open(path, "wb") as f:  # the other user's key: same format, a valid MAC under their secret
        f.write(cache_files.seal(secrets.token_bytes(32), key, payload, cache.MAGIC))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm, out1, _ = compile_and_step(mlp, x)
    assert not marker.exists()
    assert cache_warnings(caught) == [f"pipeline cache: entry {path} is not authentic (HMAC mismatch: corrupt, "
                                      f"truncated, or not written by you); not read; recompiling and replacing it"]
    assert pipeline.compile_stats(cm).cache == {"g0": "miss"} and torch.equal(out0, out1)
    cm, _, _ = compile_and_step(mlp, x)  # replaced by an authentic entry
    assert pipeline.compile_stats(cm).cache == {"g0": "hit"}


class PicklesGraphs(Executor):
    """An executor whose artifact is the code itself (a pickled GraphModule), as a compiled
    kernel is: loading the wrong one would run the wrong model."""
    name = "pickles_graphs"

    def claims_op(self, op, node):
        return True

    def compile_region(self, gm, example_inputs):
        return gm

    def artifact_unsupported_reason(self, gm, example_inputs):
        return None

    def save_region(self, fn):
        return pickle.dumps(fn)

    def load_region(self, data, gm, example_inputs):
        return pickle.loads(data)


def sine(x):
    return x.sin() * 2


def cosine(x):
    return x.cos() + 1


@pytest.mark.parametrize("sealed", ["plain checksum", "this user's key"])
def test_entry_carrying_another_regions_artifact_is_rejected(sealed):
    x = torch.randn(8)
    keys = []
    for fn in (sine, cosine):
        torch._dynamo.reset()
        pipeline.jit(fn, executors=[PicklesGraphs()])(x)
        keys += [os.path.basename(p)[: -len(".entry")] for p in entries() if not any(k in p for k in keys)]
    key_a, key_b = keys
    entry_a = cache.read_entry(key_a)
    other = next(iter(cache.read_entry(key_b)["artifacts"].values()))
    entry_a["artifacts"] = {k: other for k in entry_a["artifacts"]}  # the cosine's code under sine's key
    if sealed == "this user's key":
        cache.write_entry(key_a, entry_a)
    else:  # the old format's unkeyed checksum, recomputed
        import hashlib
        payload = pickle.dumps(entry_a)
        with open(cache.entry_path(key_a), "wb") as f:
            f.write(cache.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cf = pipeline.jit(sine, executors=[PicklesGraphs()])
        out = cf(x)
    assert torch.equal(out, sine(x))
    [warning] = cache_warnings(caught)
    assert ("another region graph" if sealed == "this user's key" else "not authentic") in warning
    assert pipeline.compile_stats(cf).cache == {"g0": "miss"}


@pytest.mark.parametrize("planted", ["fifo", "symlink", "oversized"])
def test_fifo_symlink_or_oversized_file_at_an_entry_path_is_skipped_at_once(mlp, tmp_path, planted):
    x = torch.randn(4, 16)
    compile_and_step(mlp, x)
    [path] = entries()
    key = os.path.basename(path)[: -len(".entry")]
    elsewhere = tmp_path / "elsewhere.entry"
    os.replace(path, elsewhere)  # an authentic entry: a followed link would load it
    if planted == "fifo":
        os.mkfifo(path, 0o600)
    elif planted == "symlink":
        os.symlink(elsewhere, path)
    else:
        with open(path, "wb") as f:
            f.truncate(cache_files.MAX_ENTRY_BYTES + 1)  # sparse: 1 GiB that costs no disk
        os.chmod(path, 0o600)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        assert cache.read_entry(key) is None
        assert time.perf_counter() - start < 1.0
    [warning] = cache_warnings(caught)
    assert path in warning and {"fifo": "not a regular file", "symlink": "symbolic link",
                                "oversized": "over the"}[planted] in warning
    cm, _, _ = compile_and_step(mlp, x)
    assert pipeline.compile_stats(cm).cache == {"g0": "miss"}
    assert stat.S_ISREG(os.lstat(path).st_mode)  # replaced by a fresh entry


@pytest.mark.parametrize("where", ["root group-writable", "subdir other-writable", "root of another user",
                                   "subdir of another user"])
def test_cache_others_could_write_is_turned_off_with_one_warning(mlp, monkeypatch, where):
    x = torch.randn(4, 16)
    compile_and_step(mlp, x)
    root = os.environ["PIPELINE_CACHE_DIR"]
    [path] = entries()
    subdir = os.path.dirname(path)
    cache._roots.pop(root)  # a fresh process
    if where == "root group-writable":
        os.chmod(root, 0o770)
    elif where == "subdir other-writable":
        os.chmod(subdir, 0o757)
    else:
        real, key = os.getuid(), cache_files.secret(root)
        monkeypatch.setattr(os, "getuid", lambda: real + 4242)
        if where == "subdir of another user":
            cache._roots[root] = key  # the root was checked while it was ours
    named = root if "root" in where else subdir
    for attempt in range(2):  # off for the process: the second compile does not warn again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cm, _, _ = compile_and_step(mlp, x)
        status = pipeline.compile_stats(cm).cache["g0"]
        assert status.startswith("off: untrusted") and named in status
        messages = cache_warnings(caught)
        if attempt == 0:
            [message] = messages
            assert named in message and ("chmod" in message if "writable" in where else "not by you" in message)
        else:
            assert messages == []


def test_new_directories_are_0700_and_files_0600(mlp, monkeypatch):
    monkeypatch.setattr(os, "umask", os.umask)  # restored below
    old = os.umask(0o002)  # a permissive umask: modes still private
    try:
        compile_and_step(mlp, torch.randn(4, 16))
    finally:
        os.umask(old)
    root = os.environ["PIPELINE_CACHE_DIR"]
    seen = []
    for folder, dirs, files in os.walk(root):
        seen.append((folder, stat.S_IMODE(os.stat(folder).st_mode), 0o700))
        seen += [(os.path.join(folder, f), stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode), 0o600)
                 for f in files]
    assert {p for p, _, want in seen if want == 0o600} >= {*entries(), os.path.join(root, "secret.key")}
    assert [(p, f"{mode:o}") for p, mode, want in seen if mode != want] == []


from test_cache import RACER  # noqa: E402  (one process compiling at a given time: the same script)


def test_two_processes_filling_a_new_cache_at_once_leave_one_valid_entry_and_no_stray_files(tmp_path):
    """Both race to make the cache root, its key and the entry."""
    root = tmp_path / "cache"
    env = {**os.environ, "PIPELINE_CACHE_DIR": str(root)}
    start_at = str(time.time() + 8)  # after both have imported torch
    procs = [subprocess.Popen([sys.executable, "-c", RACER, start_at], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert results[0][0].split()[-1] == results[1][0].split()[-1]
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    [entry] = [f for f in files if f.endswith(".entry")]
    assert files == sorted([entry, "secret.key"])  # no temporary files left behind
    key = os.path.basename(entry)[: -len(".entry")]
    os.environ["PIPELINE_CACHE_DIR"] = str(root)  # (restored by the autouse fixture)
    assert cache.read_entry(key) is not None


KEY = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    import torch
    import pipeline.cache
    from conftest import MLP
    real = pipeline.cache.graph_key

    def print_key(*args):
        print("KEY", real(*args), flush=True)
        os._exit(0)
    pipeline.cache.graph_key = print_key
    if sys.argv[2] == "decided":  # Inductor decides compile_threads lazily, on first use
        from torch._inductor.async_compile import get_compile_threads
        get_compile_threads()
    torch.manual_seed(0)
    pipeline.jit(MLP(), executors=["inductor"])(torch.randn(4, 16))
""")


@pytest.mark.slow  # ten processes starting Inductor's workers: about two minutes on two cores
def test_key_is_the_same_in_ten_fresh_processes(tmp_path):
    """Hash seeds, working directories, compile threads and whether Inductor has decided them yet
    differ; what is compiled does not."""
    keys, running = [], []
    for i in range(10):
        cwd = tmp_path / f"cwd{i}"
        cwd.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": str(i), "PYTHONPATH": ROOT,
               "PIPELINE_CACHE_DIR": str(tmp_path / "cache")}
        if i % 3:
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(i % 3)
        running.append(subprocess.Popen([sys.executable, "-c", KEY, ROOT, "decided" if i % 2 else "lazy"],
                                        cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        if len(running) == 5 or i == 9:
            for p in running:
                out, err = p.communicate(timeout=240)
                assert p.returncode == 0, err[-2000:]
                keys.append(out.split("KEY ")[-1].strip())
            running = []
    assert len(keys) == 10 and len(set(keys)) == 1, keys
