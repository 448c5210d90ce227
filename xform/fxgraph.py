"""FX graph <-> networkx DiGraph, for the partitioning and pattern matching of transforms.

An FX graph is a DAG of nodes; networkx gives reachability, contraction and cycle checks for free.
The CUDA-graph partitioner asks "can these two regions merge without creating a cycle?", the
attention matcher "which nodes lie between this matmul and that softmax?"; both start here.
Nodes of the DiGraph are the `fx.Node` objects themselves (hashable, unique per graph), with
attributes `op`, `target` and `order` (position in the FX graph's topological order).
"""

from __future__ import annotations

from typing import Collection, Iterable

import networkx as nx
from torch import fx
from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule, topo_sort


def to_digraph(graph: fx.Graph) -> nx.DiGraph:
    """One DiGraph node per FX node; an edge from each input of a node to the node."""
    dag = nx.DiGraph()
    for order, node in enumerate(graph.nodes):
        dag.add_node(node, op=node.op, target=node.target, order=order)
        for source in node.all_input_nodes:
            dag.add_edge(source, node)
    return dag


def merge_keeps_acyclic(dag: nx.DiGraph, group: Collection[fx.Node]) -> bool:
    """Whether contracting `group` into one node leaves the graph acyclic.

    It does not when some node outside the group is both reachable from the group and reaches it
    (a path that leaves the group and comes back): fusing the group would then need that node to
    run both before and after it.
    """
    members = set(group)
    downstream: set[fx.Node] = set()
    for node in members:
        downstream |= nx.descendants(dag, node)
    downstream -= members
    return not any(members & nx.descendants(dag, node) for node in downstream)


def quotient_is_acyclic(dag: nx.DiGraph, groups: Iterable[Collection[fx.Node]]) -> bool:
    """Whether contracting every group (disjoint sets of nodes) leaves the graph acyclic."""
    block_of = {}
    for index, group in enumerate(groups):
        for node in group:
            block_of[node] = index
    contracted = nx.DiGraph()
    for node in dag.nodes:
        contracted.add_node(block_of.get(node, node))
    for src, dst in dag.edges:
        a, b = block_of.get(src, src), block_of.get(dst, dst)
        if a != b:
            contracted.add_edge(a, b)
    return nx.is_directed_acyclic_graph(contracted)


def region_module(gm: fx.GraphModule, nodes: Collection[fx.Node], name: str = "region") -> tuple[fx.GraphModule, tuple[fx.Node, ...], tuple[fx.Node, ...]]:
    """The nodes of one region as a standalone GraphModule, with the outer nodes it reads and the
    outer-visible nodes it produces (in the order the submodule takes and returns them)."""
    ordered = topo_sort(list(nodes))
    sub, inputs, outputs = fuse_as_graphmodule(gm, ordered, name)
    return sub, tuple(inputs), tuple(outputs)
