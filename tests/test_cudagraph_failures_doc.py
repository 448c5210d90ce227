"""Every repro in docs/cudagraph-failures.md runs, gives the eager result, and is explained with
the reason the page quotes (simulated recorder: the CPU is the recorded device)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import xform
import xform.transforms.cudagraphs.transform as cudagraphs
from xform.transforms import CudaGraphs

from models import AsModule
from simulated_recorder import SimulatedRecorder

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cudagraph-failures.md"
SECTIONS = re.findall(r"^## (.+?)\n\n```python\n(.+?)```\n\nReason: `([^`]+)`", PAGE.read_text(), re.M | re.S)


def test_the_page_has_repros():
    assert len(SECTIONS) == 3


@pytest.mark.parametrize("title, code, reason", SECTIONS, ids=[s[0][:30] for s in SECTIONS])
def test_repro_is_explained_with_the_quoted_reason(monkeypatch, title, code, reason):
    monkeypatch.setattr(cudagraphs, "available_recorder", lambda: SimulatedRecorder())
    namespace = {"torch": torch, "device": "cpu"}
    exec(code, namespace)
    inputs = namespace["inputs"]
    step = AsModule(namespace["step"])  # the report keys on the module (exec'd code differs by torch version)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(step, backend=xform.Backend([CudaGraphs(min_region_ops=1)], handoff="eager"),
                                 dynamic=namespace.get("dynamic", False))
        expected = step(*[t.clone() for t in inputs])
        for _ in range(3):
            got = compiled(*[t.clone() for t in inputs])
    torch.testing.assert_close(got, expected)
    reasons = [s.reason for s in xform.report(step).skips("cudagraphs")]
    assert any(r.startswith(reason) for r in reasons), reasons
