"""Where a transformed graph goes to be compiled: Inductor (the default), eager, or Thunder.

With no transforms, the Inductor handoff calls `compile_fx` exactly as `backend="inductor"` does,
so xform adds nothing but its bookkeeping. AOT hooks (`Transform.transform_aot_graph`) are
attached only when some transform has one, through Inductor's `inner_compile` (or AOTAutograd's
compilers for the eager handoff), so graphs without them keep every Inductor cache path.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch
from torch import fx, nn

from xform._torch import inductor
from xform._torch.dispatch import is_traceable_wrapper_subclass
from xform.faults import strict
from xform.fx_rewrite import is_in_place
from xform.log import logger

# what a handoff is, which transforms check (Inductor-only refusals, say); its `label` is what the
# report shows, and may say more ("inductor (instead of thunder: ...)")
HandoffKind = Literal["inductor", "eager", "thunder"]

AotHook = Callable[[fx.GraphModule, str], None]
# wraps one AOT-compiled function (boxed: takes a list) given its kind, the indices of its inputs
# with stable addresses (parameters, buffers, inputs marked static) and of those it writes in
# place; the CUDA-graph transform records it
InnerWrapper = Callable[[Callable[..., Any], str, Sequence[int], Sequence[int]], Callable[..., Any]]


def _aot_kind(is_backward: bool, is_inference: bool) -> str:
    return "backward" if is_backward else ("inference" if is_inference else "forward")


def written_inputs(gm: fx.GraphModule) -> list[int]:
    """The positions of the inputs an AOTAutograd graph writes in place: AOTAutograd keeps a write
    into an input in the graph (`aten.copy_(input, new)`, a KV cache's `index_copy_`) where it can,
    so whoever runs the compiled function must hand it the caller's tensor itself, not a copy."""
    position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return sorted({position[n.args[0]] for n in gm.graph.nodes
                   if n.op == "call_function" and n.args and n.args[0] in position and is_in_place(n)})


class InductorHandoff:
    """Inductor's `compile_fx`, with the config patches of `mode` and `options` applied."""

    kind: HandoffKind = "inductor"
    supports_aot_hooks = True

    def __init__(self, options: dict[str, Any] | None = None, mode: str | None = None, label: str = "inductor") -> None:
        self.label = label
        patches: dict[str, Any] = {}
        if mode not in (None, "default"):
            try:
                patches.update(inductor.mode_options(mode))
            except RuntimeError as error:
                raise ValueError(f"xform: unknown torch.compile mode {mode!r}: {error}") from None
        if options:
            known = inductor.option_names()
            unknown = sorted(set(options) - set(known))
            if unknown:
                raise ValueError(
                    f"xform: unknown Inductor option(s) {unknown} in options['inductor']; "
                    f"see torch._inductor.list_options() for the accepted names"
                )
            patches.update(options)
        self.config_patches = patches or None

    def with_transform_config(self, wanted: dict[str, Any], required: dict[str, Any] | None = None,
                              by: dict[str, str] | None = None) -> None:
        """Add transforms' Inductor settings: `wanted` ones yield to the user's options; a user option
        that contradicts a `required` one (`by`: setting -> transform) is an error, since the
        transform relies on it."""
        user = self.config_patches or {}
        for key, value in (required or {}).items():
            if key in user and user[key] != value:
                owner = (by or {}).get(key, "a transform")
                raise ValueError(
                    f"xform: transform '{owner}' needs Inductor's {key}={value!r}, but the mode or options ask for "
                    f"{user[key]!r}" + (" (mode='reduce-overhead' records CUDA graphs itself: drop the mode, the "
                                        "cudagraphs transform replaces it)" if key == "triton.cudagraphs" else "")
                )
        merged = {**wanted, **(required or {}), **user}
        if merged:
            self.config_patches = merged

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], aot_hook: AotHook | None,
                wrap_inner: InnerWrapper | None = None) -> Callable[..., Any]:
        if aot_hook is None and wrap_inner is None:
            return inductor.compile_fx(gm, example_inputs, config_patches=self.config_patches)

        def inner_compile(aot_gm: fx.GraphModule, inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
            kind = _aot_kind(kwargs.get("is_backward", False), kwargs.get("is_inference", False))
            if aot_hook is not None:
                aot_hook(aot_gm, kind)
            written = written_inputs(aot_gm) if wrap_inner is not None else ()  # before Inductor edits the graph
            compiled = inductor.compile_fx_inner(aot_gm, inputs, *args, **kwargs)
            return compiled if wrap_inner is None else wrap_inner(compiled, kind, kwargs.get("static_input_idxs", ()),
                                                                  written)

        # An AOTAutograd cache hit would skip inner_compile, and with it the hooks; Inductor's own
        # FX graph cache stays on, since it keys on the graph the hook already rewrote.
        with inductor.autograd_cache_off():
            return inductor.compile_fx(gm, example_inputs, inner_compile=inner_compile,
                                       config_patches=self.config_patches)


class EagerHandoff:
    """Run the transformed graph as PyTorch code; through AOTAutograd when an AOT hook needs it, or
    when the graph's inputs mix the two kinds of tensor subclass (`_mixes_subclass_kinds`)."""

    kind: HandoffKind = "eager"
    label = "eager"
    supports_aot_hooks = True

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], aot_hook: AotHook | None,
                wrap_inner: InnerWrapper | None = None) -> Callable[..., Any]:
        if aot_hook is None and wrap_inner is None and not _mixes_subclass_kinds(example_inputs):
            return gm.forward
        def compiler(kind: str) -> Callable[..., Any]:
            def run(aot_gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                if aot_hook is not None:
                    aot_hook(aot_gm, kind)
                    aot_gm.recompile()
                compiled = inductor.boxed(aot_gm.forward)
                return compiled if wrap_inner is None else wrap_inner(compiled, kind, (), written_inputs(aot_gm))

            return run

        backend = inductor.aot_autograd(
            fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), inference_compiler=compiler("inference")
        )
        return backend(gm, example_inputs)


def _mixes_subclass_kinds(inputs: Sequence[Any]) -> bool:
    """Whether the inputs hold both a `__torch_function__` subclass Dynamo traces through (cast's
    `LowPrecisionWeight`) and a wrapper subclass (torchao's quantized weights). Dynamo runs such a
    graph with `__torch_function__` disabled, so as not to apply the first one's twice, which also
    skips the wrapper's own linear (torchao's Float8Tensor then fails on `aten.addmm`); AOTAutograd
    runs the wrapper's ops as it defines them."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return (any(map(is_traceable_wrapper_subclass, tensors))
            and any(_overrides_torch_function(t) and not is_traceable_wrapper_subclass(t) for t in tensors))


def _overrides_torch_function(t: torch.Tensor) -> bool:
    method = type(t).__torch_function__
    return getattr(method, "__func__", method) not in _PLAIN_TORCH_FUNCTIONS


# torch.Tensor's own `__torch_function__`, and nn.Parameter's (which disables it)
_PLAIN_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__.__func__, nn.Parameter.__torch_function__)


class ThunderHandoff:
    """Lightning Thunder's Dynamo backend (`thunder.dynamo.ThunderCompiler`), where it imports."""

    kind: HandoffKind = "thunder"
    label = "thunder"
    supports_aot_hooks = False

    def __init__(self) -> None:
        try:
            from thunder.dynamo import ThunderCompiler
        except Exception as error:  # thunder fails with AttributeError on torch >= 2.13, not only ImportError
            raise ValueError(
                f"xform: handoff='thunder' needs lightning-thunder, which does not import here "
                f"({type(error).__name__}: {error}). Install the extra `xform[thunder]` (lightning-thunder "
                f"0.2.6 imports with torch 2.11), or use handoff='inductor'."
            ) from None
        self._compiler_class = ThunderCompiler

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], aot_hook: AotHook | None,
                wrap_inner: InnerWrapper | None = None) -> Callable[..., Any]:
        return self._compiler_class()(gm, list(example_inputs))


Handoff = InductorHandoff | EagerHandoff | ThunderHandoff

HANDOFFS = ("inductor", "eager", "thunder")


def make_handoff(name: str, inductor_options: dict[str, Any] | None = None, mode: str | None = None) -> Handoff:
    if name not in HANDOFFS:
        raise ValueError(f"xform: unknown handoff {name!r}; accepted: {', '.join(map(repr, HANDOFFS))}")
    if name != "inductor" and (inductor_options or mode not in (None, "default")):
        raise ValueError(f"xform: Inductor options and mode apply to handoff='inductor' only, not {name!r}")
    if name == "inductor":
        return InductorHandoff(inductor_options, mode)
    if name == "eager":
        return EagerHandoff()
    try:
        return ThunderHandoff()
    except ValueError as error:
        if strict():
            raise
        fallback = InductorHandoff(label=f"inductor (instead of thunder: {error})")
        logger.warning("%s; compiling with Inductor instead (XFORM_STRICT=1 raises)", error)
        return fallback
