"""ir.rewrite: declarative patterns, one matcher, rules applied where their guard agrees."""
import operator

import torch
import torch.fx as fx

from ir.rewrite import Call, add_call, find, match, rewrite

TWICE = Call(operator.mul, ("a", "b"), a="x", b=lambda b: b == 2)  # x * 2
RESHAPED = Call("reshape", ("input", "*shape"), "out", input="x", shape="shape")


def graph_of(fn) -> fx.Graph:
    return fx.symbolic_trace(fn).graph


def calls(graph, target):
    return [n for n in graph.nodes if n.target == target]


def test_a_pattern_binds_arguments_by_position_keyword_or_method_spelling():
    def f(x):
        return x.reshape(2, 3) + torch.reshape(input=x, shape=(3, 2))

    graph = graph_of(f)
    method, function = find(graph, RESHAPED)
    x = next(iter(graph.nodes))
    assert method.root.op == "call_method" and function.root.target is torch.reshape
    assert (method["x"], method["shape"], method["out"]) == (x, (2, 3), method.root)
    assert (function["x"], function["shape"]) == (x, (3, 2))
    assert method.nodes == [method.root]


def test_nested_patterns_and_alternatives_collect_the_nodes_they_matched():
    pattern = Call(operator.add, ("a", "b"), a=TWICE | Call("neg", ("input",), input="x"), b="y")

    def f(x, y):
        return x * 2 + y, x.neg() + y, x * 3 + y

    graph = graph_of(f)
    twice, negated = find(graph, pattern)  # x * 3 + y: neither alternative
    assert [n.target for n in twice.nodes] == [operator.add, operator.mul]
    assert [n.target for n in negated.nodes] == [operator.add, "neg"]
    assert twice["x"].name == "x" and twice["y"].name == "y"


def test_no_match_for_another_target_an_unnamed_argument_or_a_failed_constraint():
    def f(x):
        return x * 3, x + 2, torch.repeat_interleave(x, 2, dim=0, output_size=4), x.repeat_interleave(2, dim=0)

    graph = graph_of(f)
    repeat = Call("repeat_interleave", ("input", "repeats", "dim"), input="x", repeats="n", dim=lambda d: d == 0)
    assert not find(graph, TWICE)  # x * 3 fails b == 2; x + 2 is another op
    (m,) = find(graph, repeat)  # output_size is not a parameter the pattern names
    assert m.root.op == "call_method" and m["n"] == 2
    assert match(repeat, "not a node") is None


def test_a_name_bound_twice_must_bind_the_same_node():
    square = Call(operator.mul, ("a", "b"), a="x", b="x")
    graph = graph_of(lambda x, y: (x * x, x * y))
    (m,) = find(graph, square)
    assert m.root.args == (m["x"], m["x"])


def test_rewrite_replaces_where_the_guard_agrees_and_leaves_the_rest():
    def f(x, y):
        return x * 2, y * 2

    graph = graph_of(f)

    def as_add(m):
        with graph.inserting_before(m.root):
            m.root.replace_all_uses_with(add_call(graph, operator.add, (m["x"], m["x"]), None))
        graph.erase_node(m.root)

    done = rewrite(graph, [(TWICE, as_add, lambda m: m["x"].name == "x")])  # the guard refuses y * 2
    assert [m["x"].name for m in done] == ["x"]
    assert [n.args[0].name for n in calls(graph, operator.add)] == ["x"]
    assert [n.args[0].name for n in calls(graph, operator.mul)] == ["y"]
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert [t.tolist() for t in gm(torch.tensor([1.0]), torch.tensor([3.0]))] == [[2.0], [6.0]]


def test_added_calls_carry_their_value_and_a_str_target_is_a_method():
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = add_call(graph, "contiguous", (x,), "value")
    assert node.op == "call_method" and node.meta["val"] == node.meta["example_value"] == "value"
