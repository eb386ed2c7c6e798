r"""The core's line budget, checked by `make test` (tinygrad-style): exit 1 when it is exceeded.

The core is every .py file under `ir/`, `pipeline/`, `executors/` and `transforms/`. Three limits,
all set in the constants below and nowhere else:
- the core as a whole: at most CORE_LINES lines;
- each file: at most FILE_LINES lines;
- each function or method: at most FUNCTION_LINES lines.

Counting: a file's lines are its non-blank lines (`grep -cv '^\s*$'`): comments and docstrings
count, blank lines do not, so spacing code out for reading costs nothing. It is the count the review
of issue 18 measured the core in (6.4k lines) when it set the 7,000 budget; `wc -l` gives ~20% more.
A function's length is `end_lineno - lineno + 1` from `ast` (its `def` line to its last line, decorators not
included); a function nested in another counts as part of its parent and is also checked, and
reported, on its own (as `outer.inner`).

Usage: `python scripts/line_budget.py` prints the totals and every offender; exit 0 within budget.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE_LINES = 7_000
FILE_LINES = 400
FUNCTION_LINES = 60
CORE_DIRS = ("ir", "pipeline", "executors", "transforms")

ROOT = Path(__file__).resolve().parent.parent


def core_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for d in CORE_DIRS for p in (root / d).rglob("*.py"))


def count_lines(text: str) -> int:
    """Non-blank lines: those with anything but whitespace on them."""
    return sum(1 for line in text.splitlines() if line.strip())


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, first line, length) of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.lineno, node.end_lineno - node.lineno + 1
            yield from functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def check(root: Path = ROOT) -> tuple[int, list[str]]:
    """The core's total line count and one line per offender."""
    total, offenders = 0, []
    for path in core_files(root):
        text = path.read_text()
        n = count_lines(text)
        total += n
        rel = path.relative_to(root)
        if n > FILE_LINES:
            offenders.append(f"file      {rel}: {n} lines (budget {FILE_LINES})")
        for name, line, length in functions(ast.parse(text, str(rel))):
            if length > FUNCTION_LINES:
                offenders.append(f"function  {rel}:{line} {name}: {length} lines (budget {FUNCTION_LINES})")
    if total > CORE_LINES:
        offenders.insert(0, f"core      {', '.join(CORE_DIRS)}: {total} lines (budget {CORE_LINES})")
    return total, offenders


def main() -> int:
    total, offenders = check()
    print(f"core: {total} lines in {len(core_files())} files (budget {CORE_LINES}; "
          f"file {FILE_LINES}, function {FUNCTION_LINES})")
    for line in offenders:
        print("over budget:", line)
    if offenders:
        print(f"{len(offenders)} over budget (limits at the top of scripts/line_budget.py)")
        return 1
    print("within budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
