"""What xform would do to a model, without a GPU: `xform.explain(model, *args, transforms=...)` from
Python (like `torch._dynamo.explain(fn)(*args)`), and `python -m xform explain TARGET [--transforms SPECS]`.

From Python, the model is copied for each trace below, so the model given is left as it was. From
the command line, TARGET names a function, `path/to/script.py:make_model` or `package.module:make_model`. The
function takes no argument and returns `(model, args)` or `(model, args, kwargs)`: an `nn.Module`
and the example inputs of one call, `model(*args, **kwargs)`, built on the CPU at any size the
CPU's memory holds (the model's train/eval mode is the one explained). It is called twice, since
each trace below changes the model it is given.

Explain traces the model twice, because a machine without a GPU cannot give both answers at once:

1. The transforms (all asked for but cudagraphs): the model as built, with its real weights, is
   compiled with them and `handoff="eager"` (Inductor compiles nothing) and called once; the report
   says what each transform changed and skipped, and why. Choices that depend on the GPU (quantize's
   kernels or its emulation, the flex-attention backend) are the CPU's here.
2. The CUDA graphs: the second model is moved to fake tensors (shapes and devices, no memory,
   nothing computed) on PyTorch's meta device, which stands in for CUDA (a PyTorch built without
   CUDA cannot index fake CUDA tensors), and traced by Dynamo with the cudagraphs transform alone.
   Every op a CUDA graph cannot record is listed with the user's line, the reason and the fix,
   with the regions around them; each Dynamo graph break ends a graph, and the graph after it
   names the line. Values read into Python (`x.item()`) are 0 here, since fake tensors hold none.
   The stand-in has limits a GPU has not: a tensor created by name on CUDA (`.cuda()`) cannot be
   made, and Dynamo keeps `torch.tensor(data, device=x.device)` as a real meta tensor that
   Dynamo's fake tensors refuse (transformers' KV cache does this: pass `use_cache=False`); either
   is said plainly, after the sections already printed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

import xform.transforms.cudagraphs.transform as cudagraphs_module
from xform._torch.dispatch import FakeTensorMode
from xform._torch.modules import convert_tensors
from xform._torch.dynamo import DynamoError
from xform._torch.pytree import tree_map
from xform.backend import Backend
from xform.registry import resolve
from xform.report import Report, Skip, report

TRAINING_DEFAULT = ("quantize:float8-rowwise", "flex-attention", "distribute:fsdp", "cudagraphs")
INFERENCE_DEFAULT = ("quantize:float8-weight-only", "flex-attention", "cudagraphs")
CONTRACT = ("it must return (model, args) or (model, args, kwargs): model an nn.Module, args a tuple of "
            "example inputs, kwargs a dict, so that model(*args, **kwargs) is one call")
# CUDA's stand-in: on a PyTorch built without CUDA, fake CUDA tensors cannot be indexed (indexing
# looks for the CUDA device); meta tensors can, and autograd runs on them
STAND_IN = torch.device("meta")


class ExplainError(ValueError):
    """A target explain cannot use, said with what to change."""


@dataclass
class Example:
    """A model and the inputs of one call, as the target's function returned them."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


# --- the target ---------------------------------------------------------------------------------


def load_target(target: str) -> Callable[[], Any]:
    """`path/to/script.py:name` or `package.module:name` (name may be dotted) -> that callable."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise ExplainError(f"target {target!r} must be SCRIPT.py:FUNCTION or MODULE:FUNCTION, e.g. "
                           f"examples/llama_train.py:make_model")
    holder = _load_script(where) if where.endswith(".py") or "/" in where else _import_module(where)
    value: Any = holder
    for part in name.split("."):
        if not hasattr(value, part):
            raise ExplainError(f"{where} has no attribute {name!r}; it defines: {_public_callables(holder)}")
        value = getattr(value, part)
    if not callable(value):
        raise ExplainError(f"{target} is a {type(value).__name__}, not a function: point at a function of no "
                           f"argument; {CONTRACT}")
    return value


def _load_script(path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ExplainError(f"no file {path!r} (looked in {Path.cwd()}); give the script's path, relative to the "
                           f"current directory or absolute")
    sys.path.insert(0, str(file.resolve().parent))  # as `python script.py` does: its neighbours import
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    spec.loader.exec_module(module)
    return module


def _import_module(name: str) -> Any:
    sys.path.insert(0, str(Path.cwd()))  # as `python -m` does
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise ExplainError(f"cannot import module {name!r} ({error}); is it installed, in the current directory "
                           f"or on PYTHONPATH? A script is named by its path: path/to/{name}.py:FUNCTION") from None


def _public_callables(holder: Any) -> str:
    names = sorted(n for n, v in vars(holder).items() if callable(v) and not n.startswith("_")
                   and getattr(v, "__module__", None) == holder.__name__)
    return ", ".join(names) or "no function of its own"


def build(factory: Callable[[], Any], target: str) -> Example:
    """Call the target's function and check what it returned against the contract."""
    returned = factory()
    got = f"{target}() returned {_kind(returned)}"
    if not isinstance(returned, (tuple, list)) or len(returned) not in (2, 3):
        raise ExplainError(f"{got}; {CONTRACT}")
    model, args, kwargs = (*returned, {})[:3]
    if not isinstance(model, nn.Module):
        raise ExplainError(f"{got}: its first item is a {type(model).__name__}, not an nn.Module; {CONTRACT}")
    if not isinstance(args, (tuple, list)):
        raise ExplainError(f"{got}: its args are a {type(args).__name__}, not a tuple (one input x is "
                           f"written (x,)); {CONTRACT}")
    if not isinstance(kwargs, dict):
        raise ExplainError(f"{got}: its kwargs are a {type(kwargs).__name__}, not a dict; {CONTRACT}")
    return Example(model, tuple(args), kwargs)


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


# --- the transforms -----------------------------------------------------------------------------


def default_transforms(model: nn.Module) -> list[str]:
    """What makes sense for the model: float8 training and FSDP when it trains, float8 weights when
    it does not; flex-attention and CUDA graphs either way."""
    training = model.training and any(p.requires_grad for p in model.parameters())
    return list(TRAINING_DEFAULT if training else INFERENCE_DEFAULT)


def parse_specs(text: str) -> list[str]:
    """`"cast:bf16,cudagraphs"` -> the specs, each checked (an unknown one raises, listing the accepted)."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ExplainError(f"--transforms {text!r} names no transform; e.g. --transforms cast:bf16,cudagraphs")
    for spec in specs:
        resolve(spec)
    return specs


def trace_transforms(example: Example, specs: list[str]) -> Report:
    """Pass 1: one call of the real model on the CPU, compiled with `specs` and handoff eager."""
    torch.compiler.reset()
    compiled = torch.compile(example.model, backend=Backend(specs, handoff="eager"))
    with torch.set_grad_enabled(example.model.training):
        _call(compiled, example)
    return report(example.model)


def _call(compiled: Callable[..., Any], example: Example) -> None:
    """One call of the compiled model, a CUDA device asked for by name said plainly."""
    try:
        compiled(*example.args, **example.kwargs)
    except (RuntimeError, AssertionError) as error:
        if any(text in str(error) for text in ("not compiled with CUDA", "not linked with support for cuda")):
            raise ExplainError(
                "the model puts a tensor on CUDA by name (.cuda(), .to('cuda'), device='cuda'), which this "
                "PyTorch, built without CUDA, cannot do even for a trace: make the model follow its inputs "
                "(device=x.device in the forward, model.to(device) outside it)") from error
        raise


# --- the CUDA graphs, on a stand-in device ------------------------------------------------------


class _NoValuesMode(FakeTensorMode):
    """Fake tensors whose values read into Python are 0 (False): a model that checks a value on the
    host (`if x.isnan().any():`) runs on, where plain fake tensors stop (they hold no value)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        return super().__torch_dispatch__(func, types, args, kwargs)


class _NoRecorder:
    """Stands for the GPU's recorder, so that the cudagraphs transform plans regions for the stand-in
    device; explain calls each region once (its warm-up), so nothing is ever recorded."""

    device_type = STAND_IN.type

    def record(self, run: Any, inputs: Any, copied: Any) -> Any:
        raise RuntimeError("xform explain records no CUDA graph")

    def warm_up(self, run: Any, inputs: Any) -> Any:
        return run(inputs)


@contextlib.contextmanager
def _planning_on_the_stand_in() -> Iterator[None]:
    saved = cudagraphs_module.available_recorder
    cudagraphs_module.available_recorder = lambda: _NoRecorder()
    try:
        with warnings.catch_warnings():  # the transform reads addresses, which fake tensors fake
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        cudagraphs_module.available_recorder = saved


def to_stand_in(example: Example, mode: FakeTensorMode) -> Example:
    """The example as fake tensors on the stand-in device (the model moved in place)."""
    def move(value: Any) -> Any:
        return mode.from_tensor(value.to(STAND_IN)) if isinstance(value, torch.Tensor) else value

    convert_tensors(example.model, move)
    return Example(example.model, tree_map(move, example.args), tree_map(move, example.kwargs))


def trace_cuda_graphs(example: Example, spec: str) -> Report:
    """Pass 2: one call traced on the stand-in device with the cudagraphs transform alone."""
    transform = resolve(spec)
    transform.warmup = sys.maxsize  # every call is a warm-up: nothing to record
    torch.compiler.reset()
    mode = _NoValuesMode(allow_non_fake_inputs=True)
    fake = to_stand_in(example, mode)
    compiled = torch.compile(fake.model, backend=Backend([transform], handoff="eager"))
    with _planning_on_the_stand_in(), mode, torch.set_grad_enabled(fake.model.training):
        try:
            _call(compiled, fake)
        except DynamoError as error:
            raise ExplainError(
                f"the CUDA-graph trace failed on CUDA's stand-in (PyTorch's meta device): {type(error).__name__}: "
                f"{str(error).strip().splitlines()[0]} ... A few things that work on a GPU fail there: Dynamo keeps "
                f"torch.tensor(data, device=x.device) as a plain meta tensor, as in transformers' KV cache "
                f"(pass use_cache=False). The sections above are complete") from error
    graphs = report(fake.model)
    for t in (t for g in graphs.graphs for t in g.transforms):
        t.skips = [Skip(s.target, _as_cuda(s.reason)) for s in t.skips]
    return graphs


def _as_cuda(reason: str) -> str:
    """A reason the analysis gave for the stand-in device, said of CUDA, where it holds the same."""
    return re.sub(rf"\b{STAND_IN.type}\b", "cuda", reason)


# --- the text -----------------------------------------------------------------------------------


def describe_example(example: Example) -> str:
    mode = "train" if example.model.training else "eval"
    count = sum(p.numel() for p in example.model.parameters())
    inputs = ", ".join(_describe_value(v) for v in example.args)
    inputs += "".join(f", {k}={_describe_value(v)}" for k, v in example.kwargs.items())
    return f"{type(example.model).__name__} ({mode} mode, {count:,} parameters), called with ({inputs})"


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


@dataclass
class Explanation:
    """What explain found: the report of the transforms' trace (None when only cudagraphs was asked
    for), the report of the CUDA-graph trace (None when cudagraphs was not), and the text, section
    by section, that `str()` joins."""

    transforms: Report | None
    cuda_graphs: Report | None
    sections: list[str]

    def __str__(self) -> str:
        return "\n".join(self.sections)


def explain(model: nn.Module, /, *args: Any, transforms: str | Sequence[str] | None = None,
            **kwargs: Any) -> Explanation:
    """What the transforms (specs, as a list or comma-separated; None: the defaults for the model's
    mode) would do to `model(*args, **kwargs)`, and every CUDA-graph break, without a GPU. Each trace
    runs on a copy of the model: `model` is left as it was. Like `python -m xform explain`, it starts
    from a clean `torch.compile` state (`torch.compiler.reset()`): models compiled before in this
    process compile again at their next call, and their xform reports are cleared."""
    if not isinstance(model, nn.Module):
        raise ExplainError(f"xform.explain takes the model (an nn.Module) first, then its inputs, not a "
                           f"{type(model).__name__}: xform.explain(model, *args, transforms=[...], **kwargs)")
    if transforms is not None and not isinstance(transforms, str) and not all(isinstance(t, str) for t in transforms):
        raise ExplainError(f"xform.explain takes transforms as spec strings (['cast:bf16', 'cudagraphs'] or "
                           f"'cast:bf16,cudagraphs'), not {[type(t).__name__ for t in transforms]}")
    specs = parse_specs(transforms if isinstance(transforms, str) else ",".join(transforms)) \
        if transforms is not None else None
    found = Explanation(None, None, [])

    def fresh() -> Example:
        return Example(copy.deepcopy(model), args, kwargs)

    for section, kind, graphs in _sections(type(model).__name__, fresh, specs, "transforms="):
        found.sections.append(section)
        if kind:
            setattr(found, kind, graphs)
    return found


def explain_target(target: str, transforms: str | None = None) -> Iterator[str]:
    """The command line's explanation of TARGET under the transforms (a comma-separated spec list;
    None: the defaults), section by section, so that what is known is shown before a later trace fails."""
    factory = load_target(target)
    specs = parse_specs(transforms) if transforms is not None else None
    for section, _, _ in _sections(target, lambda: build(factory, target), specs, "--transforms "):
        yield section


def _sections(title: str, fresh: Callable[[], Example], specs: list[str] | None,
              choose: str) -> Iterator[tuple[str, str | None, Report | None]]:
    """Each section's text, with the Explanation field its report fills, if any; `fresh()` gives a
    model not yet traced (each trace changes the model it is given)."""
    example = fresh()
    chosen = specs is not None
    specs = specs if specs is not None else default_transforms(example.model)
    graphed = [s for s in specs if s.partition(":")[0] == "cudagraphs"]
    others = [s for s in specs if s not in graphed]
    yield "\n".join([f"xform explain {title}", f"model: {describe_example(example)}",
                     f"transforms: {', '.join(specs)}" + ("" if chosen else
                                                          f" (the defaults for this mode; {choose} to choose)")]), None, None
    if others:
        graphs = trace_transforms(example, others)
        yield "\n".join(["", f"== {', '.join(others)}: one call on the CPU with the real weights, handoff eager "
                             f"(nothing compiled; choices that depend on the GPU are the CPU's here) ==", "",
                         str(graphs)]), "transforms", graphs
    if graphed:
        if others:  # the first trace changed this copy: the next one starts from a fresh one
            del example
            example = fresh()
        graphs = trace_cuda_graphs(example, graphed[0])
        yield "\n".join(["", f"== {graphed[0]}: one call traced on fake tensors of a stand-in device for CUDA (no "
                             f"GPU used, nothing computed) ==", "", graphs.describe("cudagraphs"), "",
                         _break_summary(graphs)]), "cuda_graphs", graphs


def _break_summary(graphs: Report) -> str:
    breaks = [s for s in graphs.skips("cudagraphs") if s.target != "graph" and not s.target.startswith("region ")]
    unrecorded = sum(1 for s in graphs.skips("cudagraphs") if s.target == "graph")
    recorded = len(graphs.changes("cudagraphs"))
    text = f"{len(breaks)} region break(s); {recorded} region(s) would be recorded as CUDA graphs"
    if unrecorded:
        text += f"; {unrecorded} graph(s) not recorded at all"
    return text + f", over {len(graphs.graphs)} Dynamo graph(s)"
