"""Partition a graph's ops into maximal regions of one kind (capture-safe or not), with no cycles.

Contracting a set of nodes into one call is only possible when no path leaves the set and comes
back (the outside node would have to run both before and after the call). Starting from a
labelling that is acyclic by construction (each op's level is the number of kind changes on the
longest path to it, so edges never go back a level and, within a level, join ops of one kind),
two regions of the same kind are merged whenever no path through a third region links them
(neighbours, or independent branches; checked with networkx on the contracted graph), until none
can merge. Safe regions with fewer ops than a
threshold are not worth a graph replay; they become plain, and plain neighbours merge in turn.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import networkx as nx
from torch import fx

from xform.fx_rewrite import is_in_place
from xform.transforms.cudagraphs.capture_safety import OPS, alias_base

SAFE, PLAIN = "graphed", "plain"


@dataclass
class Region:
    """Ops run as one unit: recorded as a CUDA graph (`kind == "graphed"`) or run as compiled."""

    kind: str
    nodes: list[fx.Node]
    why_plain: str | None = None  # for a plain region that holds only safe ops: why it is not graphed

    @property
    def op_count(self) -> int:
        return sum(1 for n in self.nodes if n.target is not operator.getitem)


@dataclass
class RegionPlan:
    regions: list[Region] = field(default_factory=list)  # in an order that runs (topological)

    @property
    def graphed(self) -> list[Region]:
        return [r for r in self.regions if r.kind == SAFE]


Edges = dict[fx.Node, list[fx.Node]]


def ordering_edges(ops: list[fx.Node]) -> Edges:
    """node -> the nodes that must run after it beyond its data users: around each in-place write,
    the reads of the same memory (through any view) keep their side of it. Dynamo's graphs rely on
    node order for these; regions may not reorder them."""
    position = {n: i for i, n in enumerate(ops)}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in ops:
        for source in node.all_input_nodes:
            readers.setdefault(alias_base(source), []).append(node)
    edges: Edges = {}
    for write in ops:
        if not (is_in_place(write) and write.args and isinstance(write.args[0], fx.Node)):
            continue
        for other in readers.get(alias_base(write.args[0]), []):
            if other is not write:
                before, after = (write, other) if position[other] > position[write] else (other, write)
                edges.setdefault(before, []).append(after)
    return edges


def _successors(node: fx.Node, extra: Edges) -> list[fx.Node]:
    return [*node.users, *extra.get(node, ())]


def _initial_blocks(ops: list[fx.Node], unsafe: set[fx.Node], extra: Edges) -> dict[fx.Node, tuple[int, str]]:
    kind = {n: PLAIN if n in unsafe else SAFE for n in ops}
    preds_of: dict[fx.Node, list[fx.Node]] = {n: [p for p in n.all_input_nodes if p in kind] for n in ops}
    for before, afters in extra.items():
        for after in afters:
            preds_of[after].append(before)
    level: dict[fx.Node, int] = {}
    for node in ops:  # FX order is topological, for data and ordering edges alike
        preds = preds_of[node]
        level[node] = max((level[p] + (kind[p] != kind[node]) for p in preds), default=0)
    return {n: (level[n], kind[n]) for n in ops}


def _contracted(ops: list[fx.Node], block_of: dict[fx.Node, object], extra: Edges) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_nodes_from(set(block_of.values()))
    for node in ops:
        for user in _successors(node, extra):
            if user in block_of and block_of[user] != block_of[node]:
                dag.add_edge(block_of[node], block_of[user])
    return dag


def _can_merge(dag: nx.DiGraph, a: object, b: object) -> bool:
    """Contracting a and b keeps the DAG acyclic: no path leaves one through a third block and reaches the other."""
    between = (nx.descendants(dag, a) & nx.ancestors(dag, b)) | (nx.descendants(dag, b) & nx.ancestors(dag, a))
    return not (between - {a, b})


def _merge(dag: nx.DiGraph, kind: dict[object, str]) -> dict[object, object]:
    """Merge same-kind blocks (neighbours or independent) while no merge creates a cycle; returns
    block -> the block it was merged into."""
    merged: dict[object, object] = {b: b for b in dag.nodes}
    changed = True
    while changed:
        changed = False
        blocks = sorted(dag.nodes, key=str)
        pair = next(((a, b) for i, a in enumerate(blocks) for b in blocks[i + 1:]
                     if kind[a] == kind[b] and _can_merge(dag, a, b)), None)
        if pair is not None:
            a, b = pair
            nx.contracted_nodes(dag, a, b, self_loops=False, copy=False)
            for block, into in merged.items():
                if into == b:
                    merged[block] = a
            changed = True
    return merged


def _group(ops: list[fx.Node], block_of: dict[fx.Node, object], kind: dict[object, str], extra: Edges) -> list[Region]:
    dag = _contracted(ops, block_of, extra)
    into = _merge(dag, kind)
    members: dict[object, list[fx.Node]] = {}
    for node in ops:
        members.setdefault(into[block_of[node]], []).append(node)
    return [Region(kind[b], nodes) for b, nodes in members.items()]


def _in_running_order(ops: list[fx.Node], regions: list[Region], extra: Edges) -> list[Region]:
    index = {n: i for i, r in enumerate(regions) for n in r.nodes}
    dag = _contracted(ops, index, extra)
    return [regions[i] for i in nx.lexicographical_topological_sort(dag)]


def plan_regions(gm: fx.GraphModule, unsafe: set[fx.Node], min_ops: int) -> RegionPlan:
    """The graph's ops as regions: maximal safe ones (graphed if they hold >= `min_ops` ops), and plain ones."""
    ops = [n for n in gm.graph.nodes if n.op in OPS]
    if not ops:
        return RegionPlan()
    extra = ordering_edges(ops)
    blocks = _initial_blocks(ops, unsafe, extra)
    regions = _group(ops, blocks, {b: b[1] for b in blocks.values()}, extra)
    small = [r for r in regions if r.kind == SAFE and r.op_count < min_ops]
    if small:  # demoted regions may now merge with plain neighbours
        for region in small:
            region.kind = PLAIN
        block_of = {n: i for i, r in enumerate(regions) for n in r.nodes}
        regions = _group(ops, block_of, {i: r.kind for i, r in enumerate(regions)}, extra)
    for region in regions:
        if region.kind == PLAIN and not unsafe.intersection(region.nodes):
            region.why_plain = (f"{region.op_count} op(s), below min_region_ops={min_ops}: launching them "
                                f"directly costs no more than a graph replay")
    return RegionPlan(_in_running_order(ops, regions, extra))
