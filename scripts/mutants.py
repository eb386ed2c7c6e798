"""`make test-mutants`: runs a fixed, fast subset of the tests against each mutant of the pipeline
(tests/mutants.py) and fails naming every mutant that no test kills.

The unmutated subset runs first: if it fails, a "killed" below would mean nothing. Each mutant's run
stops at its first failing test (`-x`), which is named as the killer. `--full` runs every test of
the subset under each mutant instead, and counts per file how many tests noticed it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.mutants import MUTANTS  # noqa: E402  (the plugin pytest loads as -p tests.mutants)

# fast on the torch executor (~60 s together on 2 cores); with -x most mutants die in the first file
SUBSET = ["tests/test_passes.py", "tests/test_dispatch.py", "tests/test_training_passes.py",
          "tests/test_torch_executor.py", "tests/test_training.py"]
TIMEOUT_S = 240  # per run; a mutant that makes a test hang counts as killed by the timeout


def run(mutant: str, full: bool) -> tuple[int, str]:
    """pytest's exit code on the subset under `mutant` ("" for none) and its output; -1 on timeout."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.mutants",
           *([] if full else ["-x"]), *SUBSET]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PIPELINE_MUTANT=mutant, COLUMNS="250"),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, ""
    return done.returncode, done.stdout + done.stderr


def killers(output: str) -> str:
    """The first failed (or erroring) test of a run and why, from pytest's short summary (`-ra`);
    with several, how many per file."""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", output, flags=re.M)
    if not failed:
        return "?"
    first, why = failed[0]
    tests = dict.fromkeys(f for f, _ in failed)  # a test that also fails in teardown is listed twice
    files = [f.split("::")[0] for f in tests]
    counts = ", ".join(f"{os.path.basename(f)}: {files.count(f)}" for f in dict.fromkeys(files))
    return first + (f" - {why[:120]}" if why else "") + (f"  (failed: {counts})" if len(tests) > 1 else "")


def main() -> int:
    full = "--full" in sys.argv[1:]
    start = time.perf_counter()
    rc, out = run("", full)
    if rc != 0:
        print(out[-6000:])
        print(f"test-mutants: the unmutated subset fails (pytest exit {rc}); a kill would mean nothing")
        return 1
    print(f"test-mutants: the unmutated subset passes ({time.perf_counter() - start:.0f} s): {' '.join(SUBSET)}")
    survivors = []
    for name, mutant in MUTANTS.items():
        t = time.perf_counter()
        rc, out = run(name, full)
        took = f"{name:20s} {time.perf_counter() - t:4.0f} s"
        if rc == -1:
            print(f"  killed   {took}  by a timeout ({TIMEOUT_S} s)")
        elif rc == 1:  # some test failed
            print(f"  killed   {took}  by {killers(out)}")
        elif rc == 0:
            survivors.append(name)
            print(f"  SURVIVED {took}  {mutant.__doc__.splitlines()[0]}")
        else:  # interrupted, internal or usage error: the harness broke, not a test
            print(out[-3000:])
            print(f"test-mutants: pytest exited {rc} under mutant {name}")
            return 1
    print(f"test-mutants: {len(MUTANTS) - len(survivors)} of {len(MUTANTS)} mutants killed "
          f"in {time.perf_counter() - start:.0f} s")
    if survivors:
        print(f"test-mutants: FAILED: no test kills {', '.join(survivors)} (tests/mutants.py says what each does)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
