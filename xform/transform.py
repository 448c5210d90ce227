"""`Transform`: one class, a few hooks, called in the order data flows through a compile.

For each graph Dynamo captures, the pipeline calls, for every transform in the list (in list
order), each hook the transform overrides:

1. `transform_parameters(graph, record)`: the model's weights as the graph reads them. Replace a
   parameter with `graph.replace_parameter(...)`, which also updates the module, the placeholder
   and the guard model. (A backend given by name never sees the model before tracing, so this is
   where every way of calling xform can reach the weights: the frame's modules, through the
   parameters' sources.)
2. `transform_graph(graph, record)`: the FX graph Dynamo captured (torch-level ops), e.g. rewrite
   attention, insert collectives or casts.
3. `compile_graph(graph, compile, record)`: for a transform that compiles the graph in parts of its
   own (the CUDA-graph regions): `compile(gm, example_inputs, wrap_inner=None)` hands one part to
   the handoff, `wrap_inner` wrapping each AOT-compiled function of it. Returns the callable for
   the whole graph, or None to let the handoff compile it as one. One transform at most.
4. `transform_aot_graph(gm, kind, record)`: the forward/backward graphs after AOTAutograd (aten
   ops, functionalized), for transforms that need the joint view; `kind` is "forward",
   "backward" or "inference". Only run when some transform overrides it.
5. `transform_guards(guards, record)`: the graph's expectations of its inputs (`GuardModel`), for
   changes not made through `replace_parameter`.
6. `wrap_compiled(compiled, graph, record)`: the compiled callable, for wrappers (CUDA graphs).

Ordering: `must_follow` maps the transforms that, when also listed, must come earlier to the
reason why; `must_precede` those that must come later. The pipeline checks both and refuses a list
that breaks them, rather than silently reordering what the user wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

from torch import fx

if TYPE_CHECKING:
    from xform.captured import CapturedGraph
    from xform.guards import GuardModel
    from xform.report import TransformRecord

HOOKS = ("transform_parameters", "transform_graph", "compile_graph", "transform_aot_graph", "transform_guards",
         "wrap_compiled")


def option_error(transform: str, option: str, value: Any, accepted: str) -> ValueError:
    """The error for a bad option: which transform, which option, the value given, what is accepted."""
    return ValueError(f"xform: transform '{transform}': option {option}={value!r} is not accepted; accepted: {accepted}")


class Transform:
    """Base class of xform transforms; override only the hooks the transform needs."""

    name: ClassVar[str] = ""
    # name of another transform -> why this one must run after / before it, when both are listed
    must_follow: ClassVar[dict[str, str]] = {}
    must_precede: ClassVar[dict[str, str]] = {}
    # the report's note for a graph where the transform changed, skipped and noted nothing: what it
    # looked for and did not find (a transform never does nothing silently)
    nothing_found: ClassVar[str] = "nothing in this graph it changes"

    @classmethod
    def from_spec(cls, argument: str | None) -> Transform:
        """Build from the part of a spec string after the colon (`"cast:bf16"` -> `"bf16"`)."""
        if argument is not None:
            raise ValueError(f"xform: transform '{cls.name}' takes no argument, got {cls.name}:{argument}")
        return cls()

    def transform_parameters(self, graph: CapturedGraph, record: TransformRecord) -> None:
        """Replace parameters the graph reads (cast, quantize, shard); see the module docstring."""

    def transform_graph(self, graph: CapturedGraph, record: TransformRecord) -> None:
        """Rewrite the Dynamo FX graph `graph.gm` in place."""

    def compile_graph(self, graph: CapturedGraph, compile: Callable[..., Callable[..., Any]],
                      record: TransformRecord) -> Callable[..., Any] | None:
        """Compile `graph.gm` in parts with `compile`; None leaves it to the handoff (see the module docstring)."""
        return None

    def transform_aot_graph(self, gm: fx.GraphModule, kind: str, record: TransformRecord) -> None:
        """Rewrite an AOTAutograd forward/backward/inference graph in place."""

    def transform_guards(self, guards: GuardModel, record: TransformRecord) -> None:
        """Adjust what the graph expects of its inputs."""

    def wrap_compiled(
        self, compiled: Callable[..., Any], graph: CapturedGraph, record: TransformRecord
    ) -> Callable[..., Any]:
        """Wrap the compiled callable (it takes the graph's inputs as a flat list of arguments)."""
        return compiled

    def inductor_config(self) -> dict[str, Any]:
        """Inductor settings this transform's graphs want (merged under the user's own options)."""
        return {}

    def required_inductor_config(self) -> dict[str, Any]:
        """Inductor settings this transform relies on: a user option contradicting one is an error."""
        return {}

    def overrides(self, hook: str) -> bool:
        return getattr(type(self), hook) is not getattr(Transform, hook)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"
