"""The frame Dynamo is compiling when it calls the backend, and the rest of Dynamo's private API
xform uses: its sources, its guard set, the compile id, the exceptions it handles itself.

Inside a backend call Dynamo has traced the user's frame but not yet built its guards. From here
xform can read the frame's locals (to reach the modules that own the graph's parameters), the
fake-tensor mode, and the guard set under construction, which it edits so that the guards describe
the transformed model instead of the traced one.
"""

from __future__ import annotations

import functools
import os
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch._dynamo.exc import (RestartAnalysis, ShortenTraceback, SkipFrame, TensorifyScalarRestartAnalysis,
                               TorchDynamoException, exceptions_allowed_to_be_fallback)
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from xform._torch import versions

# what AOTAutograd's fake tensors cannot trace because it depends on data: an op whose output's
# values or shape do (a Mixture-of-Experts router's; a custom op whose backward reads a tensor's
# values on the host, as transformers' grouped_mm_fallback does). Dynamo breaks a graph on these
# and the other unsupported-op exceptions a backend raises; those others may be xform's own bugs.
UNTRACEABLE = (DataDependentOutputException, DynamicOutputShapeException)

# what Dynamo answers itself when a backend raises it, so it must reach Dynamo as it is, not as a
# transform's or handoff's failure: its signals to restart or skip the analysis (a float read on the
# host becoming a tensor, say), and the exceptions it breaks the graph on (wrapped, the whole
# compile failed where torch.compile(backend="inductor") runs). Also from a transform that compiles
# the graph itself (cudagraphs' compile_graph calls the handoff).
DYNAMO_SIGNALS = (RestartAnalysis, SkipFrame, *exceptions_allowed_to_be_fallback)

DynamoError = TorchDynamoException  # what a failed Dynamo trace raises


class RetraceAfterModelChange(TensorifyScalarRestartAnalysis):
    """xform's request that Dynamo trace the frame under compilation again from its start, because
    a transform changed what the model holds in a way the traced code may have read (a weight's
    dtype: `if self.wo.weight.dtype != h.dtype`, as T5 writes), so the retrace sees the model as it
    now is. Dynamo wraps every other exception a backend raises in `BackendCompilerFailed`; this
    restart signal (that of a float read on the host becoming a tensor) it lets through and answers
    by tracing the frame again (torch 2.11 to 2.14)."""


def retrace(frame: DynamoFrame, reason: str) -> RetraceAfterModelChange:
    """The signal to raise from the backend for Dynamo to trace `frame` again. The retrace may take
    other branches than the first trace did, so Dynamo's record of where that trace may break the
    graph (its speculation log, replayed on a restart and checked against it) is cleared first."""
    frame.output_graph.root_tx.speculation_log.clear()
    return RetraceAfterModelChange(reason, restart_reason=reason)


class PassedOnError(ShortenTraceback):
    """An exception Dynamo hands to the user as it is, where it wraps any other a backend raises in
    `BackendCompilerFailed` with torch's "report a bug to PyTorch" text."""

    def __init__(self, message: str) -> None:
        super().__init__(message, first_useful_frame=None)


@dataclass
class DynamoFrame:
    """Handles onto Dynamo's state for the graph being compiled."""

    tracing_context: Any  # torch._guards.TracingContext
    output_graph: Any  # torch._dynamo.output_graph.OutputGraph

    @classmethod
    def current(cls) -> DynamoFrame | None:
        """The frame under compilation, or None when the backend is called outside Dynamo."""
        from torch._dynamo import symbolic_convert
        from torch._guards import TracingContext

        context = TracingContext.try_get()
        # torch 2.13 deletes the attribute outside tracing, 2.11 leaves None or never sets it
        tx = getattr(symbolic_convert.tls, "current_tx", None)
        if context is None or tx is None:
            return None
        return cls(tracing_context=context, output_graph=tx.output)

    @property
    def code(self) -> types.CodeType:
        """The user code being compiled; for a resume function after a graph break, the original."""
        from torch._dynamo.resume_execution import ContinueExecutionCache

        code = self.output_graph.root_tx.f_code
        resumed = ContinueExecutionCache.generated_code_metadata.get(code)
        return resumed.code if resumed is not None else code

    @property
    def code_name(self) -> str:
        """What was traced, as a user reads it: `forward`, or `forward (resumed after the graph break
        at model.py:42)` (a resume function starts at the line that broke the graph)."""
        code = self.output_graph.root_tx.f_code
        name = getattr(self.code, "co_qualname", self.code.co_name)  # co_qualname: Python 3.11+
        if code is self.code:
            return name
        return f"{name} (resumed after the graph break at {os.path.basename(code.co_filename)}:{code.co_firstlineno})"

    def evaluate(self, source: Any) -> Any:
        """The live value a guard source names (`L['fn']._modules['0']`), read like a guard reads it."""
        scope = {"L": self.output_graph.local_scope, "G": self.output_graph.global_scope}
        return eval(source.name, scope)  # noqa: S307 - source names are Dynamo's own expressions

    def register_replacement(self, source: Any, tensor: torch.Tensor) -> None:
        """Tell AOTAutograd that `tensor` (a replacement parameter, or a constant input xform adds)
        has static shapes and lives at `source`.

        AOTAutograd fakifies each real example input with the symbolic context Dynamo recorded for
        it; a tensor Dynamo never saw would get fresh symbolic sizes with no source, and any shape
        guard on them (torchao's MX kernels make some) breaks guard building.
        """
        self.tracing_context.tensor_to_context[tensor] = _static_context(source, tensor)

    def local(self, name: str) -> Any:
        """A local variable of the traced frame, or None."""
        return self.output_graph.local_scope.get(name)

    def rewrite_tensor_guards(self, expected: list[tuple[Any, torch.Tensor]]) -> None:
        """Make the guards on each source expect its tensor (type, dtype, device, shape, stride, ...);
        the old guards of all of them go in one pass over the guard set.

        Dynamo's TENSOR_MATCH guard captured a weak reference to the traced tensor and reads its
        size/stride from `input_source_to_sizes_strides`; both are replaced, so the guard checks
        the tensor the module holds now. A wrapper tensor subclass (torchao's quantized weights,
        DTensor) gets what Dynamo gives one it traces: its type, its flatten metadata and a guard
        on each inner tensor, since the compiled code is specialized on all of them.
        """
        if not expected:
            return
        guards = self.tracing_context.guards_context.dynamo_guards
        _remove_guards_on(guards, [source for source, _ in expected])
        for source, tensor in expected:
            self._add_tensor_guards(guards, source, tensor)

    def _add_tensor_guards(self, guards: Any, source: Any, tensor: torch.Tensor) -> None:
        from torch._dynamo.guards import GuardBuilder
        from torch._dynamo.source import AttrSource, SubclassAttrListSource
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
        from torch.utils.weak import TensorWeakRef

        def add(src: Any, builder: Any) -> None:
            guards.add(src.make_guard(builder), collect_debug_stack=False)

        self.output_graph.input_source_to_sizes_strides[source] = {
            "size": tuple(tensor.size()),
            "stride": tuple(tensor.stride()),
        }
        add(source, functools.partial(GuardBuilder.TENSOR_MATCH, value=TensorWeakRef(tensor)))
        if not is_traceable_wrapper_subclass(tensor):
            return
        add(source, GuardBuilder.TYPE_MATCH)
        if _is_dtensor(tensor):
            add(AttrSource(source, "_spec"), GuardBuilder.DTENSOR_SPEC_MATCH)
            add(AttrSource(source, "requires_grad"), GuardBuilder.EQUALS_MATCH)
        else:
            add(source, GuardBuilder.TENSOR_SUBCLASS_METADATA_MATCH)
            add(SubclassAttrListSource(source), GuardBuilder.EQUALS_MATCH)
        for attr in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, attr)
            if isinstance(inner, torch.Tensor):
                self._add_tensor_guards(guards, AttrSource(source, attr), inner)

    def rewrite_module_type_guard(self, source: Any) -> None:
        """Re-check the type of the module at `source` against what the frame holds now (after a swap).

        Guards on the old type's class attributes go too: Dynamo reads them through the type's MRO
        by position (`type(m).__mro__[1].__dict__['_compiled_call_impl']`, for a module with hooks),
        which names another class, or none, in the new type's MRO."""
        from torch._dynamo.guards import GuardBuilder

        guards = self.tracing_context.guards_context.dynamo_guards
        _remove_guards_on(guards, [source], exact=True, kinds=("TYPE_MATCH", "ID_MATCH"))
        _remove_guards_on(guards, [source], through_type=True)
        guards.add(source.make_guard(GuardBuilder.TYPE_MATCH), collect_debug_stack=False)


def _static_context(source: Any, tensor: torch.Tensor) -> Any:
    from torch._dynamo.source import AttrSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatefulSymbolicContext, SubclassSymbolicContext
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    dims = {"dynamic_sizes": [DimDynamic.STATIC] * tensor.dim(), "constraint_sizes": [None] * tensor.dim(),
            "tensor_source": source}
    if not is_traceable_wrapper_subclass(tensor):
        return StatefulSymbolicContext(**dims)
    inner = {
        attr: _static_context(AttrSource(source, attr), getattr(tensor, attr))
        for attr in tensor.__tensor_flatten__()[0]
        if isinstance(getattr(tensor, attr), torch.Tensor)
    }
    return SubclassSymbolicContext(**dims, inner_contexts=inner)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return torch.distributed.is_available() and isinstance(tensor, torch.distributed.tensor.DTensor)


def _derived_from(source: Any, targets: set[Any]) -> bool:
    """Whether `source` is one of `targets` or reads through one (`target.size()`, `target._base`, ...)."""
    from torch._dynamo.source import ChainedSource

    while source is not None:
        if source in targets:
            return True
        source = source.base if isinstance(source, ChainedSource) else None
    return False


def _remove_guards_on(guards: Any, sources: list[Any], *, exact: bool = False, kinds: tuple[str, ...] = (),
                      through_type: bool = False) -> None:
    """Drop the guards on `sources` and (unless `exact`) on what derives from them, optionally only
    those of the given kinds; `through_type`: those on what derives from their types instead. One
    pass over the guard set, whatever the number of sources. (`GuardsSet.remove_guards_with_source`
    in torch 2.11 compares only the root of each guard's source, so it never matches a parameter.)"""
    from torch.utils._ordered_set import OrderedSet

    targets = set(sources)
    types = [f"type({s.name})" for s in sources]

    def doomed(guard: Any) -> bool:
        if through_type:
            return any(name in guard.name for name in types)
        on = guard.originating_source in targets if exact else _derived_from(guard.originating_source, targets)
        return on and (not kinds or guard.create_fn_name() in kinds)

    kept = [g for g in guards if not doomed(g)]
    if versions.GUARDS_SET_CLEARS:  # also indexed by source: clear() resets both
        guards.clear()
    else:
        guards.inner = OrderedSet()
    for guard in kept:
        guards.add(guard, collect_debug_stack=False)


def placeholder_source(node: fx.Node) -> Any | None:
    """The Dynamo source of a placeholder (`L['x']`, `L['self']._modules['fc']._parameters['weight']`)."""
    grapharg = node.meta.get("grapharg")
    return getattr(grapharg, "source", None)


def update_placeholder(node: fx.Node, real: torch.Tensor, fake: torch.Tensor) -> Callable[[], None]:
    """Point a placeholder's recorded example at a replacement tensor. Returns what puts Dynamo's
    record of the input back: it is shared with Dynamo's own graph, which outlives a failed transform."""
    node.meta["example_value"] = fake
    grapharg = node.meta.get("grapharg")
    if grapharg is None:
        return lambda: None
    saved = (grapharg._example, grapharg.example_strong_ref, grapharg.fake_tensor)
    grapharg._example = torch.utils.weak.TensorWeakRef(real)
    grapharg.example_strong_ref = real
    grapharg.fake_tensor = fake

    def restore() -> None:
        grapharg._example, grapharg.example_strong_ref, grapharg.fake_tensor = saved

    return restore


def calling_module_path(node: fx.Node, roots: Sequence[str] = ()) -> str | None:
    """The path of the innermost module whose forward made this call (`layers.0.attn.q`), from
    Dynamo's `nn_module_stack` record; None for calls made outside any submodule.

    The record starts at the expression that reached the compiled module in the traced frame:
    `L['self']`, or `L['args'][0]` (a forward wrapped by a decorator taking `*args`),
    `L['fn'].__self__` (`torch.compile(model.forward)`), `L['fn'].func` (a `functools.partial`),
    `G['model']`. `roots` are those expressions for the graph's modules (their parameters' root
    sources); the longest one the record starts with is cut off, so that the path is the module's
    own within the model. Without one, the frame's first name is."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _type = list(stack.values())[-1]
    root = next((r for r in sorted(roots, key=len, reverse=True) if path == r or path.startswith((f"{r}.", f"{r}["))),
                None)
    path = path[len(root):] if root is not None else re.sub(r"^[LG]\['[^']+'\]", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]|\['([^']+)'\]|\[(\d+)\]", lambda m: "." + next(g for g in m.groups() if g), path)
    return path.lstrip(".")


@dataclass(frozen=True)
class ModuleAttribute:
    """Where a parameter lives: `owner.<name>`, and the module path from the compiled root."""

    owner_source: Any
    name: str
    module_path: str
    root_source: Any
    owner_parent_source: Any | None  # None when the owner is the compiled root itself
    owner_key: str | None  # the owner's name in its parent's `_modules`


def _unwrapped(source: Any) -> Any:
    """Strip Dynamo's marker sources (`UnspecializedNNModuleSource(...)` and kin), which name the
    same value as their base and only record how Dynamo treats it."""
    from torch._dynamo.source import ChainedSource

    while isinstance(source, ChainedSource) and source.name == source.base.name:
        source = source.base
    return source


def module_attribute(source: Any) -> ModuleAttribute | None:
    """Decode `L['fn']._modules['a']._modules['b']._parameters['w']` into owner, name and path `a.b`.

    Returns None for tensors that are not module parameters or buffers (function arguments, globals).
    """
    from torch._dynamo.source import AttrSource, DictGetItemSource

    def keyed(src: Any, member: str) -> bool:
        return (
            isinstance(src, DictGetItemSource)
            and isinstance(src.base, AttrSource)
            and src.base.member == member
        )

    source = _unwrapped(source)
    if not (keyed(source, "_parameters") or keyed(source, "_buffers")):
        return None
    owner_source = _unwrapped(source.base.base)
    path: list[str] = []
    parents: list[Any] = []
    node = owner_source
    while keyed(node, "_modules"):
        path.append(str(node.index))
        node = _unwrapped(node.base.base)
        parents.append(node)
    return ModuleAttribute(
        owner_source=owner_source,
        name=str(source.index),
        module_path=".".join(reversed(path)),
        root_source=node,
        owner_parent_source=parents[0] if parents else None,
        owner_key=path[0] if path else None,
    )


def constant_source(name: str) -> Any:
    """A Dynamo source for a tensor xform adds as a graph input (no frame local holds it)."""
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def current_compile_id() -> str | None:
    """Dynamo's id of the frame being compiled (`0/1`), or None outside a Dynamo compile."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else None


def has_static_address(tensor: torch.Tensor) -> bool:
    """Whether the caller marked `tensor` with `torch._dynamo.mark_static_address` (Hugging Face's
    static KV cache does): it keeps its address from call to call, as a buffer does."""
    return getattr(tensor, "_dynamo_static_input_type", None) is not None


def original_callable(compiled: Any) -> Any:
    """What `torch.compile` was given: the module of an `OptimizedModule`, the function of a
    compiled function; anything else as it is."""
    return getattr(compiled, "_orig_mod", None) or getattr(compiled, "_torchdynamo_orig_callable", None) or compiled


def resumed_function_name(name: str) -> str:
    """The user's function a name of Dynamo's resume function stands for (the code after a graph
    break: `torch_dynamo_resume_in_forward_at_42` -> `forward`); other names as they are."""
    return re.sub(r"^torch_dynamo_resume_in_(.+)_at_\d+$", r"\1", name)


_RESET_MARK = "xform: no torch.compiler.reset() since this mark"


def reset_since_last_asked() -> bool:
    """Whether `torch.compiler.reset()` ran since the last call (the first call: False). It clears
    Dynamo's warn-once set, where a mark is kept for this: reset has no hook of its own."""
    from torch._dynamo.utils import warn_once_cache

    missing = _RESET_MARK not in warn_once_cache
    warn_once_cache.add(_RESET_MARK)
    return missing
