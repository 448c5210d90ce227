"""xform: a torch.compile backend that rewrites the FX graph and its guards through composable
transforms, then hands the result to Inductor.

    torch.compile(model, backend="xform", options={"transforms": ["cast:bf16"]})
    torch.compile(model, backend=xform.Backend(["cast:bf16"]))
    xform.compile(model, "cast:bf16")
    print(xform.report(compiled))
    print(xform.explain(model, x, transforms=["cast:bf16", "cudagraphs"]))   # without a GPU
"""

from xform import transforms
from xform.backend import Backend, compile
from xform.captured import CapturedGraph, GraphParameter
from xform.explainer import Explanation, explain
from xform.guards import GuardChange, GuardModel, TensorExpectation
from xform.log import configure_from_env, quiet_dependencies
from xform.registry import TransformNotAvailable, available_transforms, register_transform
from xform.report import Report, report
from xform.transform import Transform

configure_from_env()
quiet_dependencies()

__all__ = [
    "Backend",
    "CapturedGraph",
    "Explanation",
    "GraphParameter",
    "GuardChange",
    "GuardModel",
    "Report",
    "TensorExpectation",
    "Transform",
    "TransformNotAvailable",
    "available_transforms",
    "compile",
    "explain",
    "register_transform",
    "report",
    "transforms",
]
