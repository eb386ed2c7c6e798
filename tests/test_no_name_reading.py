"""The core never learns what a value or a trace is from its name: which inputs are primals, tangents
or RNG seeds comes from AOTAutograd's input descriptors (the `InputSpec` kinds built from them), a
trace's stage from `Trace.stage`. Node names are AOTAutograd's and Dynamo's to change."""
import pathlib
import re

CORE = ("ir", "pipeline", "executors", "transforms")
ROOT = pathlib.Path(__file__).resolve().parent.parent

_AOT_NAME = r"(primals|tangents|fwd_seed|fwd_base_offset|bwd_seed|bwd_base_offset|fwd_rng_state|bwd_rng_state)"
_STAGE = r"(captured|joint|forward|backward|inference)"
NAME_READING = [
    (re.compile(r"""\.startswith\(\s*\(?\s*f?["']""" + _AOT_NAME), "a node name's prefix"),
    (re.compile(r"""["']""" + _AOT_NAME + r"""\w*["']\s+(not\s+)?in\b"""), "a substring of a node name"),
    (re.compile(r"""\.name\s*(\[|\.(rsplit|split|partition|rpartition)\()"""), "a piece of a name"),
    (re.compile(r"""\bin\s+[\w.]+\.name\b(?!\s*\()"""), "a substring of a name"),
    (re.compile(r"""\.endswith\(\s*\(?\s*f?["']_?""" + _STAGE + r"""["']"""), "a trace name's suffix"),
]


def name_reading_checks(root: pathlib.Path = ROOT) -> list[str]:
    """`file:line: what` for every line of the core that reads a name to learn what something is."""
    found = []
    for package in CORE:
        for path in sorted((root / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                for pattern, what in NAME_READING:
                    if pattern.search(code):
                        found.append(f"{path.relative_to(root)}:{number}: reads {what}: {line.strip()}")
                        break
    return found


def test_the_core_reads_no_names_to_learn_what_a_value_or_trace_is():
    found = name_reading_checks()
    assert not found, ("use the trace's InputSpec/OutputSpec kinds (by position) or Trace.stage instead:\n"
                       + "\n".join(found))


def test_the_check_finds_each_kind_of_name_reading(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "bad.py").write_text(
        'if node.name.startswith("primals_"):\n'
        '    pass\n'
        'if "tangents" not in node.name:\n'
        '    stage = trace.name.rsplit("_", 1)[-1]\n'
        'forward = trace.name.endswith("_forward")\n'
        'k = int(node.name[8:])\n'
        'seed = any(m in spec.name for m in ("bwd_seed", "bwd_rng_state"))\n')
    found = name_reading_checks(tmp_path)
    assert [f.split(":")[1] for f in found] == ["1", "3", "4", "5", "6", "7"]
    assert found[0].startswith("pipeline/bad.py:1: reads a node name's prefix")
