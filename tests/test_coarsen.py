"""Graph coarsening: the paper's Fig. 7, fusion-rule semantics, DAG/partition properties, real models."""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from torch import nn

from moirai.errors import FusionRuleError
from moirai.frontend.coarsen import BALANCE_FACTOR, coarsen, print_coarsening_table
from moirai.frontend.fusion_rules import BUNDLED_RULE_SETS, load_rules, parse_rules
from moirai.frontend.graph import OpEdge, OpGraph, OpNode, build_op_graph
from moirai.frontend.trace import trace

TARGETS = {
    "add": "aten.add.Tensor",
    "relu": "aten.relu.default",
    "conv": "aten.conv2d.default",
    "bn": "aten.batch_norm.default",
    "norm": "aten.layer_norm.default",
    "sigmoid": "aten.sigmoid.default",
}


def hand_graph(kinds: list[str], edges: list[tuple[int, int]], edge_bytes: list[float] | None = None) -> OpGraph:
    """An OpGraph with node i of aten op TARGETS[kinds[i]] (nodes must be given in topological order)."""
    nodes = tuple(
        OpNode(f"{kind}{i}", (TARGETS[kind],), (f"{kind}{i}",), float(i + 1), 10.0 * (i + 1), 4.0, frozenset(), 0.0)
        for i, kind in enumerate(kinds)
    )
    sizes = edge_bytes or [4.0] * len(edges)
    return OpGraph(nodes, tuple(OpEdge(s, d, nodes[s].name, b) for (s, d), b in zip(edges, sizes, strict=True)))


def named_groups(graph: OpGraph, result) -> set[tuple[str, ...]]:
    return {tuple(graph.nodes[i].name for i in group) for group in result.groups}


def test_fig7_groups_exactly_as_the_paper_describes():
    # Fig. 7 as the text describes it: the root add feeds the upper branch (add-relu three times)
    # and the lower branch (conv1-bn-conv2-bn), which joins the last add of the upper branch.
    names = ["add0", "relu0", "add1", "relu1", "conv1", "bn1", "conv2", "bn2", "add2", "relu2"]
    kinds = ["add", "relu", "add", "relu", "conv", "bn", "conv", "bn", "add", "relu"]
    index = {name: i for i, name in enumerate(names)}
    edges = [
        ("add0", "relu0"), ("add0", "conv1"), ("relu0", "add1"), ("add1", "relu1"), ("relu1", "add2"),
        ("conv1", "bn1"), ("bn1", "conv2"), ("conv2", "bn2"), ("bn2", "add2"), ("add2", "relu2"),
    ]  # fmt: skip
    graph = hand_graph(kinds, [(index[a], index[b]) for a, b in edges])
    result = coarsen(graph, "eigen")
    as_names = {tuple(names[i] for i in group) for group in result.groups}
    # add0-relu0: multi-output, not fused; add1-relu1: bound, never completed, unbound;
    # conv1-bn: rule 1; conv2-bn then add2-relu2 (bound): rule 3 over a multi-input connection.
    assert as_names == {
        ("add0",),
        ("relu0",),
        ("add1",),
        ("relu1",),
        ("conv1", "bn1"),
        ("conv2", "bn2", "add2", "relu2"),
    }
    assert {f.rule for f in result.fusions} == {"eigen:conv_bn", "eigen:conv_bn_add_relu"}
    assert result.original.nodes == 10 and result.fused.nodes == 6 and result.coarse.nodes == 6


def test_partial_match_binds_then_completes_or_unbinds():
    only_long = parse_rules('[[rule]]\nops = ["conv", "bn", "relu"]\n', "long.toml")
    complete = hand_graph(["conv", "bn", "relu"], [(0, 1), (1, 2)])
    assert coarsen(complete, only_long).groups == ((0, 1, 2),)
    incomplete = hand_graph(["conv", "bn", "sigmoid"], [(0, 1), (1, 2)])
    assert coarsen(incomplete, only_long).groups == ((0,), (1,), (2,))


def test_unbinding_keeps_the_fusions_inside_a_bound_group():
    # conv-bn fuses (rule 1), extends to conv-bn-add (part of rule 3, bound); no relu follows,
    # so unbind releases the add and keeps conv-bn.
    graph = hand_graph(["conv", "bn", "add", "sigmoid"], [(0, 1), (1, 2), (2, 3)])
    assert named_groups(graph, coarsen(graph, "eigen")) == {("conv0", "bn1"), ("add2",), ("sigmoid3",)}


def test_multi_output_edge_fuses_only_under_a_multi_output_rule():
    # add feeds a norm and, as a residual, a later add (Fig. 6b).
    graph = hand_graph(["add", "norm", "relu", "add"], [(0, 1), (0, 3), (1, 2), (2, 3)])
    strict = parse_rules('[[rule]]\nops = ["add", "norm"]\n', "strict.toml")
    allowing = parse_rules('[[rule]]\nops = ["add", "norm"]\nmulti_output = true\n', "cut.toml")
    assert coarsen(graph, strict).groups == ((0,), (1,), (2,), (3,))
    result = coarsen(graph, allowing)
    assert named_groups(graph, result) == {("add0", "norm1"), ("relu2",), ("add3",)}
    assert nx.is_directed_acyclic_graph(result.graph.to_networkx())


def test_quantifiers_optional_and_repeated():
    rules = parse_rules('[[rule]]\nops = ["conv", "bn?", "relu+"]\n', "q.toml")
    skipped = hand_graph(["conv", "relu", "relu", "relu"], [(0, 1), (1, 2), (2, 3)])
    assert coarsen(skipped, rules).groups == ((0, 1, 2, 3),)
    assert coarsen(hand_graph(["conv", "bn"], [(0, 1)]), rules).groups == ((0,), (1,))


def even_graph(kinds: list[str], edges: list[tuple[int, int]]) -> OpGraph:
    """Like hand_graph, but every op has the same work (100 FLOPs), so path lengths count ops."""
    nodes = tuple(
        OpNode(f"{kind}{i}", (TARGETS[kind],), (f"{kind}{i}",), 100.0, 0.0, 4.0, frozenset(), 0.0)
        for i, kind in enumerate(kinds)
    )
    return OpGraph(nodes, tuple(OpEdge(s, d, nodes[s].name, 4.0) for s, d in edges))


JOIN_RULE = '[[rule]]\nops = ["relu", "add"]\n'
# A source, branch A (relu1-relu2-relu3) and branch B joined by add; relu-add spells the rule.
TWO_BRANCHES = [(0, 1), (1, 2), (2, 3), (0, 4), (4, 5), (5, 6), (3, 7), (6, 7)]


def test_a_join_whose_other_input_comes_later_is_not_fused_onto_the_critical_path():
    # Branches of three ops each: fusing relu3 with add makes relu3 wait for branch B's end, so the path
    # through the group (4 + 2 ops) outruns the unfused critical path (5 ops); likewise relu6 for branch A.
    graph = even_graph(["sigmoid", "relu", "relu", "relu", "relu", "relu", "relu", "add"], TWO_BRANCHES)
    result = coarsen(graph, parse_rules(JOIN_RULE, "join.toml"))
    assert result.groups == tuple((i,) for i in range(8))
    assert result.fusions == ()


def test_a_join_whose_other_input_is_ready_first_still_fuses():
    # Branch B is one op, done before relu3 can start: relu3-add waits for nothing.
    edges = [(0, 1), (1, 2), (2, 3), (0, 4), (3, 5), (4, 5)]
    graph = even_graph(["sigmoid", "relu", "relu", "relu", "relu", "add"], edges)
    result = coarsen(graph, parse_rules(JOIN_RULE, "join.toml"))
    assert named_groups(graph, result) == {("sigmoid0",), ("relu1",), ("relu2",), ("relu3", "add5"), ("relu4",)}


def test_a_join_fuses_where_the_wait_stays_within_the_critical_path():
    # As in the first test, plus a chain of six ops from the source: the critical path (7 ops) now
    # exceeds the path through relu3-add (6 ops), so the fusion costs no plan anything the bound sees.
    chain = [(0, 8)] + [(i, i + 1) for i in range(8, 13)]
    kinds = ["sigmoid", "relu", "relu", "relu", "relu", "relu", "relu", "add"] + ["sigmoid"] * 6
    graph = even_graph(kinds, TWO_BRANCHES + chain)
    result = coarsen(graph, parse_rules(JOIN_RULE, "join.toml"))
    assert ("relu3", "add7") in named_groups(graph, result)
    assert [f.rule for f in result.fusions] == ["join:relu+add"]


def uniform_chain(length: int, edge_bytes: list[float] | None = None) -> OpGraph:
    nodes = tuple(
        OpNode(f"n{i}", ("aten.sigmoid.default",), (f"n{i}",), 100.0, 0.0, 4.0, frozenset(), 0.0) for i in range(length)
    )
    sizes = edge_bytes or [4.0] * (length - 1)
    return OpGraph(nodes, tuple(OpEdge(i, i + 1, f"n{i}", sizes[i]) for i in range(length - 1)))


def test_size_target_merges_heaviest_transfer_first():
    result = coarsen(uniform_chain(6, edge_bytes=[1, 1, 1, 1000, 1]), "eigen", target_nodes=5)
    assert result.groups == ((0,), (1,), (2,), (3, 4), (5,))


def test_size_target_keeps_groups_balanced():
    result = coarsen(uniform_chain(24), "eigen", target_nodes=4)
    assert len(result.groups) == 4
    assert max(node.flops for node in result.graph.nodes) <= BALANCE_FACTOR * 2400 / 4


def test_size_target_reaches_any_size_even_without_a_safe_edge():
    # A crown (every source feeds every sink) has no edge that is provably the only path.
    crown = hand_graph(["sigmoid"] * 6, [(s, d) for s in range(3) for d in range(3, 6)])
    for target in (5, 3, 1):
        result = coarsen(crown, "eigen", target_nodes=target)
        assert len(result.groups) == target
        assert nx.is_directed_acyclic_graph(result.graph.to_networkx())


def test_rule_naming_an_unknown_op_class_names_file_and_line(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        '# my rules\n[[rule]]\nname = "ok"\nops = ["conv", "bn"]\n\n'
        '[[rule]]\nname = "typo"\nops = [\n  "conv",\n  "bnn",\n]\n'
    )
    with pytest.raises(FusionRuleError, match=rf"{path}:10: rule 'typo' names unknown op class 'bnn'"):
        load_rules(path)


def test_user_file_may_define_op_classes(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[classes]\nsquash = ["aten.sigmoid"]\n\n[[rule]]\nops = ["conv", "squash"]\n')
    graph = hand_graph(["conv", "sigmoid"], [(0, 1)])
    assert coarsen(graph, path).groups == ((0, 1),)
    assert coarsen(graph, [str(path), "eigen"]).rule_sources == ("mine", "eigen")


def test_bad_rule_specs_are_moirai_errors():
    with pytest.raises(FusionRuleError, match="neither a bundled rule set nor a file"):
        load_rules("tensorrt")
    with pytest.raises(FusionRuleError, match="not valid TOML"):
        parse_rules("[[rule]\nops = 1", "broken.toml")
    with pytest.raises(FusionRuleError, match="unknown key"):
        parse_rules('[[rule]]\nops = ["conv"]\nmulti-output = true\n', "typo.toml")


def test_every_bundled_rule_set_loads():
    for name in (*BUNDLED_RULE_SETS, "default"):
        assert load_rules(name).rules


# --- properties on random DAGs and random rule sets --------------------------------------------

KINDS = ["add", "relu", "conv", "bn"]
CLASS_OF_KIND = {"add": "add", "relu": "relu", "conv": "conv", "bn": "bn"}


@st.composite
def random_cases(draw):
    node_count = draw(st.integers(1, 30))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=node_count, max_size=node_count))
    pairs = [(s, d) for d in range(node_count) for s in range(max(0, d - 6), d)]
    edges = sorted(draw(st.sets(st.sampled_from(pairs), max_size=3 * node_count)) if pairs else set())
    tensor_bytes = draw(st.lists(st.floats(1, 1e6), min_size=node_count, max_size=node_count))
    edge_bytes = [tensor_bytes[src] for src, _ in edges]  # a tensor has one size, whoever reads it
    rule_lines = []
    for _ in range(draw(st.integers(1, 4))):
        words = draw(st.lists(st.sampled_from(["add", "relu", "conv", "bn", "any"]), min_size=1, max_size=4))
        words = [w + draw(st.sampled_from(["", "", "?", "+", "*"])) for w in words]
        multi_output = draw(st.booleans())
        rule_lines.append(f"[[rule]]\nops = {words!r}\nmulti_output = {str(multi_output).lower()}\n".replace("'", '"'))
    target = draw(st.one_of(st.none(), st.integers(1, node_count)))
    return hand_graph(kinds, edges, edge_bytes), parse_rules("\n".join(rule_lines), "random.toml"), target


@settings(max_examples=150, deadline=None)
@given(random_cases())
def test_coarsening_properties(case):
    graph, rules, target = case
    result = coarsen(graph, rules, target_nodes=target)
    coarse = result.graph
    assert nx.is_directed_acyclic_graph(coarse.to_networkx())
    assert sorted(op for group in result.groups for op in group) == list(range(len(graph.nodes)))
    if target is not None:
        assert len(coarse.nodes) <= target
    group_of = {op: g for g, group in enumerate(result.groups) for op in group}
    for g, group in enumerate(result.groups):
        assert list(group) == sorted(group)
        assert coarse.nodes[g].fx_names == tuple(graph.nodes[i].name for i in group)  # topological: index order
    for total in ("flops", "bytes_moved", "output_bytes"):
        assert math.isclose(sum(getattr(n, total) for n in coarse.nodes), sum(getattr(n, total) for n in graph.nodes))
    crossing = {
        (group_of[e.src], group_of[e.dst], e.tensor): e.bytes for e in graph.edges if group_of[e.src] != group_of[e.dst]
    }
    assert {(e.src, e.dst, e.tensor): e.bytes for e in coarse.edges} == crossing
    multi_output_rules = {rule.name for rule in rules.rules if rule.multi_output}
    consumers = {}
    for e in graph.edges:
        consumers.setdefault(e.src, set()).add(e.dst)
    for fusion in result.fusions:
        members = set(fusion.ops)
        assert len(members) >= 2 and members <= set(result.groups[group_of[fusion.ops[0]]])
        cut = any(consumers.get(op, set()) & members and consumers.get(op, set()) - members for op in members)
        assert not cut or fusion.rule in multi_output_rules


# --- real models ---------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(8), BasicBlock(8), BasicBlock(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def small_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertModel(
        transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=100,
            max_position_embeddings=64,
        )
    )
    gpt2 = transformers.GPT2Model(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, use_cache=False)
    )
    swin = transformers.SwinModel(
        transformers.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
        )
    )
    tokens = torch.randint(0, 100, (1, 16))
    return {
        "bert": (bert.eval(), (tokens,)),
        "gpt2": (gpt2.eval(), (tokens,)),
        "swin": (swin.eval(), (torch.randn(1, 3, 32, 32),)),
    }


def test_small_resnet_fuses_every_conv_bn_relu():
    graph = build_op_graph(trace(SmallResNet().eval(), (torch.randn(1, 3, 8, 8),)))
    result = coarsen(graph, "eigen")
    rules = sorted(f.rule for f in result.fusions)
    assert rules == ["eigen:conv_bn_add_relu"] * 3 + ["eigen:conv_bn_relu"] * 4
    assert result.fused.nodes == len(graph.nodes) - 2 * 4 - 3 * 3


def test_transformers_coarsen_to_dags_with_fused_attention():
    results = {}
    for name, (model, args) in small_transformers().items():
        graph = build_op_graph(trace(model, args))
        result = coarsen(graph, "default", target_nodes=16)
        results[name] = result
        assert nx.is_directed_acyclic_graph(result.graph.to_networkx())
        assert sorted(f for node in result.graph.nodes for f in node.fx_names) == sorted(graph.node_of_fx_name)
        assert sum(f.rule == "transformer:attention_sdpa" for f in result.fusions) == 2  # one per layer
        assert result.original.nodes > result.fused.nodes > result.coarse.nodes and result.coarse.nodes <= 16
    console = Console(record=True, width=200)
    print_coarsening_table(results, console)
    text = console.export_text()
    for name, result in results.items():
        assert f"{name} " in text and f" {result.original.nodes} " in text and f" {result.fused.nodes} " in text
    print(text)


def test_split_along_a_coarse_placement_gives_the_original_outputs():
    split = pytest.importorskip("moirai.runtime.split")
    from moirai.runtime.local import run_local

    models = {"resnet": (SmallResNet().eval(), (torch.randn(1, 3, 8, 8),)), "bert": small_transformers()["bert"]}
    for model, args in models.values():
        traced = trace(model, args)
        result = coarsen(build_op_graph(traced), "default", target_nodes=12)
        node_device = {fx_name: g % 3 for g, node in enumerate(result.graph.nodes) for fx_name in node.fx_names}
        program = split.split_module(traced, node_device, num_devices=3)
        flat_inputs = traced.flatten_inputs(args, {})
        expected = traced.graph_module(*flat_inputs)
        outputs = run_local(program, flat_inputs, ["cpu"] * 3)
        assert len(outputs) == len(expected)
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
