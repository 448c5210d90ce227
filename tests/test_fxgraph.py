"""FX <-> networkx helpers: structure, cycle-safe merging, regions back to runnable modules."""

from __future__ import annotations

import torch
from torch import fx

from xform.fxgraph import merge_keeps_acyclic, quotient_is_acyclic, region_module, to_digraph


def diamond() -> fx.GraphModule:
    def f(x):
        a = x.sin()
        b = a.cos()  # a -> b -> d and a -> c -> d
        c = a.exp()
        d = b + c
        return d.relu()

    return fx.symbolic_trace(f)


def nodes_by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def test_to_digraph_has_one_node_per_fx_node_and_data_edges():
    gm = diamond()
    dag = to_digraph(gm.graph)
    n = nodes_by_name(gm)

    assert set(dag.nodes) == set(gm.graph.nodes)
    assert set(dag.successors(n["sin"])) == {n["cos"], n["exp"]}
    assert dag.nodes[n["add"]]["op"] == "call_function" and dag.nodes[n["cos"]]["target"] == "cos"
    assert [dag.nodes[x]["order"] for x in gm.graph.nodes] == list(range(len(gm.graph.nodes)))


def test_merging_around_an_outside_path_would_create_a_cycle():
    gm = diamond()
    dag = to_digraph(gm.graph)
    n = nodes_by_name(gm)

    assert not merge_keeps_acyclic(dag, [n["sin"], n["add"]])  # cos and exp lie between, outside
    assert merge_keeps_acyclic(dag, [n["sin"], n["cos"], n["exp"], n["add"]])
    assert merge_keeps_acyclic(dag, [n["cos"], n["exp"]])  # siblings: no path between them


def test_quotient_acyclic_for_a_partition():
    gm = diamond()
    dag = to_digraph(gm.graph)
    n = nodes_by_name(gm)

    assert quotient_is_acyclic(dag, [[n["sin"], n["cos"]], [n["exp"], n["add"]]])
    assert not quotient_is_acyclic(dag, [[n["sin"], n["add"]], [n["cos"]]])


def test_region_module_runs_the_region():
    gm = diamond()
    n = nodes_by_name(gm)

    sub, inputs, outputs = region_module(gm, [n["cos"], n["exp"], n["add"]])

    assert [i.name for i in inputs] == ["sin"] and [o.name for o in outputs] == ["add"]
    a = torch.randn(5)
    torch.testing.assert_close(sub(a), a.cos() + a.exp())
