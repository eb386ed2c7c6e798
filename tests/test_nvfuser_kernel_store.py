"""nvFuser's kernel database kept in the cache (`executors/nvfuser_kernel_store.py`): on only with the
cache, in a folder of its own that TMPDIR points at only while nvFuser compiles, held by one process
at a time, and emptied before nvFuser reads it when a row could pair a source with another kernel's
cubin. (nvFuser reading and writing it is tested on the GPU: tests/test_cuda.py.)"""
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from executors import nvfuser_kernel_store as store
from executors.artifact_files import set_artifact_files_root
from ir import PipelineWarning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A fresh store state with the pipeline's cache at tmp_path; the lock is let go afterwards."""
    state = {}
    monkeypatch.setattr(store, "_state", state)
    monkeypatch.delenv("NVFUSER_ENABLE", raising=False)
    set_artifact_files_root(str(tmp_path))
    yield tmp_path
    set_artifact_files_root(None)
    if "lock" in state:
        state["lock"].close()


def options_and_tmpdir():
    with store.compiling() as options:
        return options, os.environ.get("TMPDIR")


def database_of(folder, rows, sources):
    db = os.path.join(folder, "nvfuser_kernel_db")
    os.makedirs(db, exist_ok=True)
    with open(os.path.join(db, "db.csv"), "w") as f:
        f.write("kernel_signature,compile_args,kernel_code_file,cubin_file\n" + "".join(r + "\n" for r in rows))
    for i, source in enumerate(sources):
        for ext, data in ((".cu", source), (".cubin", f"cubin of {source}")):
            with open(os.path.join(db, f"kernel_{i}{ext}"), "w") as f:
                f.write(data)
    return db


def row(i, args="--std=c++17 --gpu-architecture=sm_90 -default-device --fmad=true -DNDEBUG"):
    return f"_ZN11CudaCodeGen7kernel{i}E,{args},kernel_{i}.cu,kernel_{i}.cubin"


def test_on_with_the_cache_in_its_own_folder_and_tmpdir_restored(cache_root, monkeypatch):
    monkeypatch.setenv("TMPDIR", "/somewhere")
    options, inside = options_and_tmpdir()
    assert options == {"_enable_options": ["kernel_db"], "_disable_options": ["parallel_compile"]}
    assert os.path.dirname(inside) == str(cache_root / "nvfuser") and os.stat(inside).st_mode & 0o077 == 0
    assert os.environ["TMPDIR"] == "/somewhere" and store.status() == f"nvFuser kernels kept in {inside}"
    monkeypatch.delenv("TMPDIR")
    assert options_and_tmpdir() == (options, inside) and "TMPDIR" not in os.environ


def test_off_without_the_cache_or_when_nvfuser_enable_has_its_own(cache_root, monkeypatch):
    set_artifact_files_root(None)
    assert options_and_tmpdir()[0] == {} and not (cache_root / "nvfuser").exists()
    set_artifact_files_root(str(cache_root))
    monkeypatch.setenv("NVFUSER_ENABLE", "id_model,kernel_db(/elsewhere)")
    assert options_and_tmpdir()[0] == {} and "NVFUSER_ENABLE" in store.status()


def test_off_once_the_cache_is_off_even_after_kernels_were_kept(cache_root):
    """nvFuser opens its database once per process, but once the pipeline's cache is off (a root
    refused as untrusted turns it off for the process) nothing reads or adds kernels there."""
    assert options_and_tmpdir()[0]
    set_artifact_files_root(None)
    assert options_and_tmpdir() == ({}, os.environ.get("TMPDIR"))
    set_artifact_files_root(str(cache_root))
    assert options_and_tmpdir()[0]


HOLDER = textwrap.dedent("""
    import sys, warnings
    from executors import nvfuser_kernel_store as store
    from executors.artifact_files import set_artifact_files_root
    set_artifact_files_root(sys.argv[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with store.compiling() as options:
            print(options, [str(w.message) for w in caught])
""")


def test_one_process_at_a_time_holds_the_store(cache_root):
    options, folder = options_and_tmpdir()
    assert options
    other = subprocess.run([sys.executable, "-c", HOLDER, str(cache_root)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.startswith("{} ") and f"another process holds {folder}" in other.stdout, other.stdout
    store._state.pop("lock").close()  # let go: the next process holds it
    other = subprocess.run([sys.executable, "-c", HOLDER, str(cache_root)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert "kernel_db" in other.stdout, other.stdout + other.stderr[-2000:]


@pytest.mark.parametrize("damage, why", [
    (lambda db: None, None),
    (lambda db: os.remove(os.path.join(db, "kernel_1.cubin")), r"kernel_1's files do not read \(FileNotFoundError\)"),
    (lambda db: database_of(os.path.dirname(db), [row(0), row(2)], ["a", "b", "c"]), "row 2"),
    (lambda db: open(os.path.join(db, "db.csv"), "w").write("blah\n" + row(0)), "has no header"),
    (lambda db: database_of(os.path.dirname(db), [row(0), row(1)], ["a", "a"]), "repeats"),
    (lambda db: database_of(os.path.dirname(db), [row(0), "garbage", row(2)], ["a", "b", "c"]), "row 2"),
    (lambda db: (os.remove(os.path.join(db, "kernel_0.cu")), os.symlink("/etc/passwd", os.path.join(db, "kernel_0.cu"))),
     "kernel_0.cu .*is a symbolic link"),
    # nvFuser writes compile args its own pattern does not read back (scan/sort kernels' -I/usr/...)
    (lambda db: database_of(os.path.dirname(db), [row(0), row(1, "--std=c++17 -I/usr/local/cuda/include"), row(2)],
                            ["a", "b", "c"]), "row 2"),
    (lambda db: database_of(os.path.dirname(db), [row(0), row(1, "a,b"), row(2)], ["a", "b", "c"]), "row 2"),
    (lambda db: open(os.path.join(db, "kernel_2.cubin"), "w").close(), "kernel_2's .cu or .cubin is empty"),
    (lambda db: (os.rename(os.path.join(db, "db.csv"), os.path.join(db, "other")),
                 os.symlink(os.path.join(db, "other"), os.path.join(db, "db.csv"))), "db.csv .*is a symbolic link"),
    (lambda db: (os.remove(os.path.join(db, "db.csv")), os.mkfifo(os.path.join(db, "db.csv"))), "db.csv .*is not a regular file"),
    (lambda db: (os.remove(os.path.join(db, "kernel_1.cu")), os.mkdir(os.path.join(db, "kernel_1.cu"))),
     "kernel_1.cu .*is not a regular file"),
])
def test_a_database_nvfuser_would_misread_is_emptied_first(cache_root, damage, why):
    """nvFuser numbers a new kernel by how many rows it read: a row it skips, or a source twice, would
    give the next kernel the files of one it keeps (its cubin run for another source)."""
    folder = store._folder()
    store._state.pop("lock").close()
    store._state.clear()
    db = database_of(folder, [row(0), row(1), row(2)], ["a", "b", "c"])
    damage(db)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store._folder() == folder
    said = [str(w.message) for w in caught if issubclass(w.category, PipelineWarning)]
    if why is None:
        assert said == [] and sorted(os.listdir(db)) == sorted(
            ["db.csv"] + [f"kernel_{i}{e}" for i in range(3) for e in (".cu", ".cubin")])
    else:
        assert len(said) == 1 and re.search(why, said[0]), said
        assert not os.path.lexists(db) and os.path.exists("/etc/passwd")  # nvFuser makes it again when it opens it


def test_a_store_grown_past_its_cap_starts_again(cache_root, monkeypatch):
    """Kernel names hold their fusion's order in the process, so runs of other models add rows rather
    than find them: past the cap the store is emptied, not read whole by every process."""
    monkeypatch.setattr(store, "MAX_KERNELS", 2)
    folder = store._folder()
    store._state.pop("lock").close()
    store._state.clear()
    db = database_of(folder, [row(0), row(1), row(2)], ["a", "b", "c"])
    with pytest.warns(PipelineWarning, match="or more than 2 kernels"):
        store._folder()
    assert not os.path.lexists(db)


def test_threads_swap_tmpdir_one_at_a_time_and_restore_it(cache_root, monkeypatch):
    """TMPDIR is the process's: a second thread compiling waits for the first, or the first's restore
    would leave the second compiling elsewhere, and the second's leave TMPDIR pointing at the store."""
    monkeypatch.setenv("TMPDIR", "/somewhere")
    inside, release, order = threading.Event(), threading.Event(), []

    def first():
        with store.compiling():
            order.append("first in")
            inside.set()
            release.wait(10)
            order.append("first out")

    def second():
        inside.wait(10)
        with store.compiling():
            order.append(("second in", os.environ["TMPDIR"]))
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    inside.wait(10)
    time.sleep(0.3)  # the second thread is at its compile by now
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["first in", "first out", ("second in", store._state["folder"])], order
    assert os.environ["TMPDIR"] == "/somewhere"


def test_a_removed_and_remade_folder_is_no_longer_written(cache_root):
    """The lock held is on the removed folder's file: a new process may hold the new one."""
    assert options_and_tmpdir()[0]
    folder = store._state["folder"]
    os.remove(os.path.join(folder, "lock"))
    open(os.path.join(folder, "lock"), "a").close()
    assert options_and_tmpdir()[0] == {}


def test_a_relative_cache_root_gives_nvfuser_an_absolute_folder(cache_root, monkeypatch):
    monkeypatch.chdir(cache_root)
    set_artifact_files_root("relative")
    os.makedirs("relative", 0o700)
    assert os.path.isabs(options_and_tmpdir()[1])


def test_a_link_in_place_of_the_database_is_removed_not_followed(cache_root, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "keep.cu").write_text("x")
    folder = store._folder()
    store._state.pop("lock").close()
    store._state.clear()
    os.symlink(elsewhere, os.path.join(folder, "nvfuser_kernel_db"))
    with pytest.warns(PipelineWarning, match="not a folder"):
        store._folder()
    assert not os.path.lexists(os.path.join(folder, "nvfuser_kernel_db")) and (elsewhere / "keep.cu").exists()


WARM = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, "tests")
    import pipeline
    from conftest import MLP
    from executors import nvfuser_kernel_store as store
    torch.manual_seed(0)
    model, x = MLP().cuda(), torch.randn(4, 16, device="cuda")
    cm = pipeline.jit(model, executors=["nvfuser"])
    out = cm(x)
    out.sum().backward()
    table = pipeline.regions(cm)
    folder = os.path.join(store._state["folder"], "nvfuser_kernel_db")
    db = os.path.join(folder, "db.csv")
    print(json.dumps({"cache": pipeline.compile_stats(cm).cache, "status": store.status(),
                      "nvfuser_regions": sum(r.executor == "nvfuser" for r in table),
                      "kernels_kept": len(open(db).read().splitlines()) - 1, "db": open(db).read(),
                      "written": {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)},
                      "values": [t.detach().cpu().flatten().tolist() for t in [out, *(p.grad for p in model.parameters())]]}))
""")


@pytest.mark.cuda
def test_a_warm_process_finds_every_nvfuser_kernel_in_the_store(tmp_path):
    """The cold process keeps each kernel nvFuser compiled; the warm one (a cache hit: nvFuser's
    fusions are defined again) compiles none — with kernel_db on, a kernel it did not find would be
    written as a new row, and an emptied store written again — and computes bit-identical values."""
    pytest.importorskip("nvfuser_direct")
    env = {**os.environ, "PIPELINE_CACHE_DIR": str(tmp_path / "cache"), "PIPELINE_CACHE": "1"}
    runs = []
    for _ in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", WARM], cwd=ROOT, env=env, text=True, capture_output=True,
                              timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["cache"] == {"g0": "miss"} and warm["cache"] == {"g0": "hit"}, (cold, warm)
    assert cold["nvfuser_regions"] > 0 and warm["nvfuser_regions"] == cold["nvfuser_regions"]
    assert str(tmp_path / "cache") in warm["status"], warm["status"]
    assert cold["kernels_kept"] > 0 and warm["kernels_kept"] == cold["kernels_kept"], (cold, warm)
    assert warm["db"] == cold["db"] and warm["written"] == cold["written"]  # nothing written again
    assert warm["values"] == cold["values"]
