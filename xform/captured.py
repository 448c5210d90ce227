"""One graph Dynamo captured, as the transforms see it: the FX graph, its example inputs, the
parameters it reads (with the modules that own them) and what it expects of each input.

`CapturedGraph.replace_parameter` is the one way a transform changes what a parameter *is*: it
puts the new tensor in the owning module (so the model really holds it), in the example inputs
(so the handoff compiles for it), on the placeholder (so later passes see its dtype and shape) and
in the guard model (so the compiled code is guarded on it).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import fx, nn

from xform._torch.dispatch import FakeTensor, forget_real_tensor
from xform._torch.dynamo import (DynamoFrame, ModuleAttribute, calling_module_path, constant_source,
                                 module_attribute, placeholder_source, update_placeholder)
from xform._torch.modules import carry_over
from xform.fx_rewrite import fake_like
from xform.guards import GuardChange, GuardModel, TensorExpectation
from xform.optimizers import Replacement

if TYPE_CHECKING:
    from xform.handoff import HandoffKind


DerivedInputs = Callable[[tuple], tuple]  # a call's inputs (as Dynamo passes them) -> the tensors xform adds


def _own_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The same module over a copy of its graph (nodes copied, their meta dicts shallow-copied)."""
    graph = fx.Graph(owning_module=gm)
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    copy = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta.update(getattr(gm, "meta", {}))
    return copy


@dataclass
class GraphParameter:
    """A parameter the graph reads as an input, and where it lives in the model."""

    node: fx.Node
    index: int  # position in the example inputs
    source: str  # Dynamo's name for it: L['fn']._modules['0']._parameters['weight']
    fqn: str  # module path + name, as in `model.named_parameters()`: "0.weight"
    owner: nn.Module | None  # None when it is not a module attribute (a function argument)
    name: str | None
    tensor: torch.Tensor
    traced_value: Any = None  # the fake tensor Dynamo traced the graph with, before any replacement

    def __post_init__(self) -> None:
        self.traced_value = self.node.meta.get("example_value")

    @property
    def module_path(self) -> str:
        return self.fqn.rpartition(".")[0]


class CapturedGraph:
    """A Dynamo graph plus what transforms need to change it consistently."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], frame: DynamoFrame | None,
                 handoff: HandoffKind = "inductor") -> None:
        self.gm = _own_copy(gm)  # Dynamo keeps reading its graph after the backend returns: edit a copy
        self.handoff = handoff  # the kind of handoff the graph goes to next: transforms may depend on what it compiles
        self.example_inputs = list(example_inputs)
        self.frame = frame
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.dynamo_input_count = len(self.placeholders)
        self._sources: dict[str, Any] = {}
        self._locations: dict[str, ModuleAttribute] = {}
        self._live_modules: dict[str, nn.Module] = {}
        # what the pipeline appends to every call, in placeholder order: a constant tensor, or a
        # function of the call's own inputs giving a tuple of tensors (`add_derived_inputs`)
        self.added_inputs: list[torch.Tensor | DerivedInputs] = []
        self._undo: list[Callable[[], None]] = []  # how to take back what was done to the model
        self._inherited = 0  # how many of those an earlier trace of the frame made (`inherit`)
        self.replacements: list[Replacement] = []  # the parameters replaced in the model, for its optimizers
        self._after_compile: list[Callable[[], None]] = []  # what `release` puts back in Dynamo's records
        self._parameter_names: dict[int, list[str]] | None = None  # id(parameter) -> its names (`names_of`)
        self.parameters: list[GraphParameter] = []
        expectations = []
        for index, (node, value) in enumerate(zip(self.placeholders, self.example_inputs)):
            source = placeholder_source(node)
            if source is None or not isinstance(value, torch.Tensor):
                continue
            name = source.name
            self._sources[name] = source
            location = module_attribute(source)
            if location is not None:
                self._locations[name] = location
            role = "parameter" if isinstance(value, nn.Parameter) else ("buffer" if location else "input")
            expectations.append(TensorExpectation.of(name, role, value))
            if role == "parameter":
                self.parameters.append(self._graph_parameter(node, index, name, location, value))
        self.guards = GuardModel(expectations)

    def _graph_parameter(
        self, node: fx.Node, index: int, name: str, location: ModuleAttribute | None, value: torch.Tensor
    ) -> GraphParameter:
        owner = None
        if location is not None and self.frame is not None:
            owner = self.frame.evaluate(location.owner_source)
        fqn = ".".join(p for p in (location.module_path, location.name) if p) if location else name
        return GraphParameter(node, index, name, fqn, owner, location.name if location else None, value)

    @property
    def code(self) -> types.CodeType | None:
        return self.frame.code if self.frame is not None else None

    def root_modules(self) -> list[nn.Module]:
        """The modules the graph's parameters and buffers hang from (the compiled model, normally
        one); for a model with neither, the module whose code Dynamo traced (`self` / `fn`)."""
        if self.frame is None:
            return []
        candidates = [self.frame.evaluate(location.root_source) for location in self._locations.values()]
        candidates += [self.frame.local(name) for name in ("self", "fn")]
        roots: list[nn.Module] = []
        for root in candidates:
            if isinstance(root, nn.Module) and all(root is not r for r in roots):
                roots.append(root)
        return roots

    def calling_module_path(self, node: fx.Node) -> str | None:
        """The path, within the model, of the innermost module whose forward made this call
        (`model.layers.0.mlp.up_proj`), however the model was called; None outside any submodule."""
        return calling_module_path(node, self.root_sources())

    def root_sources(self) -> set[str]:
        """How the traced frame reaches the modules the graph's parameters hang from (`L['self']`,
        `L['args'][0]` in a decorator's wrapper, `L['fn'].__self__`, ...)."""
        return {location.root_source.name for location in self._locations.values()}

    def names_of(self, tensor: torch.Tensor) -> list[str]:
        """Every name the root modules reach `tensor` by as a parameter (more than one: tied weights,
        as a head sharing its embedding's weight, even when the graph reads it under one name only)."""
        if self._parameter_names is None:
            self._parameter_names = {}
            for root in self.root_modules():
                for name, value in root.named_parameters(remove_duplicate=False):
                    names = self._parameter_names.setdefault(id(value), [])
                    if name not in names:
                        names.append(name)
        return self._parameter_names.get(id(tensor), [])

    def parameters_held_by_graph_module(self) -> list[str]:
        """Parameters the graph module owns (read with get_attr/call_module) instead of taking as inputs."""
        return [name for name, _ in self.gm.named_parameters()]

    def parameter_for(self, node: fx.Node) -> GraphParameter | None:
        return next((p for p in self.parameters if p.node is node), None)

    def replace_parameter(
        self, param: GraphParameter, new: nn.Parameter, *, by: str, placement: str | None = None
    ) -> GuardChange:
        """Make the model hold `new` where `param` was, and make the graph and its guards expect it."""
        if param.owner is None or param.name is None:
            raise ValueError(
                f"xform: transform '{by}' cannot replace {param.source}: it is not a module parameter "
                f"(passed as an argument?), so there is no module attribute to hold the replacement"
            )
        owner, name, old = param.owner, param.name, getattr(param.owner, param.name)
        self.on_undo(lambda: setattr(owner, name, old))
        setattr(owner, name, new)
        self.replacements.append(Replacement(old, new, param.fqn, by))
        self.on_undo(self.replacements.pop)
        return self._adopt(param, new, by=by, placement=placement)

    def _adopt(self, param: GraphParameter, new: torch.Tensor, *, by: str, placement: str | None = None) -> GuardChange:
        """Make the graph and its guards expect `new`, which the model already holds where `param` was."""
        self.example_inputs[param.index] = new
        restore = update_placeholder(param.node, new, fake_like(param.node.meta["example_value"], new))
        self.on_undo(restore)
        self._after_compile.append(restore)
        if self.frame is not None:
            self.frame.register_replacement(self._sources[param.source], new)
        param.tensor = new
        return self.guards.expect(param.source, new, changed_by=by, placement=placement)

    def replace_module(self, param: GraphParameter, new: nn.Module, *, by: str) -> None:
        """Put `new` in place of the module that owns `param` (Linear -> Float8Linear), and guard its type.

        The new module normally keeps the old one's parameter objects; any it replaces are adopted
        as replaced parameters.
        """
        location = self._locations.get(param.source)
        if location is None or location.owner_parent_source is None:
            raise ValueError(
                f"xform: transform '{by}' cannot replace the module holding {param.source}: it is the compiled "
                f"module itself, not a submodule; wrap it in a container (nn.Sequential(model)) to transform it"
            )
        old = param.owner
        parent, key = self.frame.evaluate(location.owner_parent_source), location.owner_key
        carry_over(old, new)
        self.on_undo(lambda: setattr(parent, key, old))
        setattr(parent, key, new)
        owner_name = location.owner_source.name
        self._sources[owner_name] = location.owner_source
        self._live_modules[owner_name] = new
        self.guards.swap_module(owner_name, type(old), type(new), changed_by=by)
        for other in self.parameters:
            if other.owner is old:
                other.owner = new
                held = getattr(new, other.name)
                if held is not other.tensor:
                    self.replacements.append(Replacement(other.tensor, held, other.fqn, by))
                    self.on_undo(self.replacements.pop)
                    self._adopt(other, held, by=by)

    def add_constant_input(self, name: str, tensor: torch.Tensor) -> fx.Node:
        """A tensor the transformed graph reads on every call (a BlockMask's indices, say), made a new
        graph input that xform passes itself, after the inputs Dynamo passes.

        Not a buffer of the graph module: AOTAutograd takes those for the model's parameters and
        wants a Dynamo source for each. Returns the new placeholder.
        """
        self.added_inputs.append(tensor)
        return self._add_input(name, tensor)

    def add_derived_inputs(self, name: str, compute: DerivedInputs, examples: Sequence[torch.Tensor]) -> list[fx.Node]:
        """Tensors the graph reads that xform computes on every call from the call's own inputs
        (`compute(args)`, args as Dynamo passes them), before the compiled graph runs: work hoisted
        out of the graph so that it can be skipped when its inputs did not change. `examples` are
        real tensors of what `compute` gives for the example inputs. Returns the new placeholders."""
        self.added_inputs.append(compute)
        return [self._add_input(f"{name}_{i}", tensor) for i, tensor in enumerate(examples)]

    def dynamo_input_index(self, node: fx.Node) -> int | None:
        """Where placeholder `node` is among the inputs Dynamo passes (None: one xform added)."""
        index = self.placeholders.index(node)
        return index if index < self.dynamo_input_count else None

    def _add_input(self, name: str, tensor: torch.Tensor) -> fx.Node:
        g = self.gm.graph
        with g.inserting_after(self.placeholders[-1] if self.placeholders else None):
            node = g.placeholder(f"xform_{name}")
        traced = next((p.meta["example_value"] for p in self.placeholders  # not a size (SymInt) input
                       if isinstance(p.meta.get("example_value"), FakeTensor)), None)
        node.meta["example_value"] = fake_like(traced, tensor) if traced is not None else tensor
        self.placeholders.append(node)
        self.example_inputs.append(tensor)
        if self.frame is not None:
            self.frame.register_replacement(constant_source(f"xform_{name}"), tensor)
        return node

    def modules_replaced_by(self, transform: str) -> list[nn.Module]:
        """The modules `transform` put into the model in this graph (with `replace_module`)."""
        return [self._live_modules[swap.source] for swap in self.guards.module_swaps if swap.changed_by == transform]

    def on_undo(self, action: Callable[[], None]) -> None:
        """Register how to take back a change a transform made to the model (run if it fails)."""
        self._undo.append(action)

    def release(self) -> None:
        """Drop what ties the compiled code to Dynamo's compile state once it is done: the undo
        actions, and the graph's records of Dynamo's inputs and fake tensors, as Dynamo's own
        cleanup drops them from its graph. The compiled code may keep this graph (the eager handoff
        runs it), and through those records, weak references to the model's tensors (in Dynamo's
        graph arguments, its fake mode's memo) that make `model.to()` and `model.float()` refuse to
        swap them."""
        self._undo.clear()
        while self._after_compile:  # Dynamo's graph arguments, shared with its graph: as Dynamo traced them
            self._after_compile.pop()()
        fake_mode = next((v.fake_mode for v in (n.meta.get("example_value") for n in self.placeholders)
                          if isinstance(v, FakeTensor)), None)
        for tensor in [r.new for r in self.replacements] + [t for t in self.added_inputs if isinstance(t, torch.Tensor)]:
            if fake_mode is not None:
                forget_real_tensor(fake_mode, tensor)
        for module in self.gm.modules():  # regions split off share the nodes' meta: their example values stay
            keys = ("grapharg", "example_value", "val") if module is self.gm else ("grapharg",)
            for node in getattr(getattr(module, "graph", None), "nodes", ()):
                for key in keys:
                    node.meta.pop(key, None)
        self.frame = None

    def inherit(self, undo: list[Callable[[], None]], replacements: list[Replacement]) -> None:
        """Take on the changes an earlier trace of this frame made to the model (`xform.retrace`):
        undone with this graph's own if its compile fails, and followed by the optimizers."""
        self._undo[:0] = undo
        self.replacements[:0] = replacements
        self._inherited = len(undo)

    def take_undo(self) -> list[Callable[[], None]]:
        """The undo actions registered so far, oldest first, handed over (this graph keeps none)."""
        undo, self._undo, self._inherited = self._undo, [], 0
        return undo

    def undo_model_changes(self, keep_inherited: bool = False) -> None:
        """Take back, newest first, every change made to the model through this graph (but for
        `keep_inherited`, those an earlier trace of the frame made)."""
        while len(self._undo) > (self._inherited if keep_inherited else 0):
            self._undo.pop()()
        self._inherited = min(self._inherited, len(self._undo))

    def install_guards(self) -> list[GuardChange]:
        """Make Dynamo guard the transformed model; returns the tensor changes installed."""
        changes = self.guards.changes
        if changes or self.guards.module_swaps:
            if self.frame is None:
                raise RuntimeError("xform: the model was changed outside a Dynamo compile; no guards to rewrite")
            live = {p.source: p.tensor for p in self.parameters} | self._live_modules
            self.guards.install(self.frame, self._sources, live)
        return changes

    def node_count(self) -> int:
        return len(self.gm.graph.nodes)
