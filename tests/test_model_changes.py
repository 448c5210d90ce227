"""The model changing under the compiled code: each change gets a correct recompile or a correct
result from the code already compiled, never a stale one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xform
from models import ConvNet, mlp

TRANSFORMS = [[], ["cast:bf16"], ["quantize:float8-rowwise"], ["flex-attention"]]
IDS = ["none", "cast", "quantize", "flex-attention"]


class Block(nn.Module):
    """Linear, dropout, batch norm and attention: every mode-dependent layer kind."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.drop(self.fc(x)))
        q = h.view(x.shape[0], 8, 4, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape_as(x)


def compiled(model: nn.Module, transforms: list[str]):
    return xform.compile(model, *transforms, handoff="eager")


@pytest.mark.parametrize("transforms", TRANSFORMS, ids=IDS)
def test_train_eval_toggles(transforms):
    model = Block()
    run = compiled(model, transforms)
    x = torch.randn(4, 8, 32)
    torch.manual_seed(1)
    train_out = run(x)
    torch.manual_seed(1)
    torch.testing.assert_close(train_out, model(x))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x))
    model.train()
    torch.manual_seed(2)
    again = run(x)
    torch.manual_seed(2)
    torch.testing.assert_close(again, model(x))


@pytest.mark.parametrize("transforms", TRANSFORMS, ids=IDS)
def test_no_grad_and_inference_mode(transforms):
    model = Block().eval()
    run = compiled(model, transforms)
    x = torch.randn(4, 8, 32)
    run(x)  # the first call transforms the model: compare with the model as it now is
    expected = model(x)
    with torch.no_grad():
        torch.testing.assert_close(run(x), expected)
    if transforms == ["quantize:float8-rowwise"]:
        # torchao's Float8Linear (rowwise) refuses inference_mode on 3-D inputs, by hand and eager too
        with torch.inference_mode(), pytest.raises(AssertionError, match="axiswise scaling is not supported"):
            model(x)
    else:
        with torch.inference_mode():
            torch.testing.assert_close(run(x), expected)
    out = run(x)
    assert out.requires_grad
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("transforms", TRANSFORMS[:3], ids=IDS[:3])
def test_requires_grad_flip(transforms):
    model = mlp(32)
    run = compiled(model, transforms)
    x = torch.randn(4, 32)
    run(x).sum().backward()
    frozen = model[0].weight
    frozen.grad = None
    frozen.requires_grad_(False)
    run(x).sum().backward()
    assert frozen.grad is None and model[2].weight.grad is not None


@pytest.mark.parametrize("transforms", TRANSFORMS[:3], ids=IDS[:3])
def test_assigned_weight_is_used(transforms):
    model = mlp(32)
    run = compiled(model, transforms)
    x = torch.randn(4, 32)
    run(x)
    model[2].weight = nn.Parameter(torch.zeros_like(model[2].weight, dtype=torch.float32))
    out = run(x)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(out, model[2].bias.float().expand_as(out), check_dtype=False)


@pytest.mark.parametrize("transforms", TRANSFORMS[:3], ids=IDS[:3])
def test_loaded_state_dict_is_used(transforms):
    model, other = mlp(32), mlp(32)
    run = compiled(model, transforms)
    x = torch.randn(4, 32)
    run(x)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(run(x), model(x))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "channels_last"])
def test_non_contiguous_and_channels_last_inputs(layout):
    model = ConvNet()
    run = compiled(model, ["cast:bf16"])
    base = torch.randn(2, 3, 16, 16)
    run(base)
    x = {"transposed": base.transpose(2, 3), "sliced": torch.randn(2, 3, 16, 32)[..., ::2],
         "channels_last": base.to(memory_format=torch.channels_last)}[layout]
    torch.testing.assert_close(run(x), model(x))


def test_new_dtype_and_new_batch_sizes():
    model = mlp(32)
    run = compiled(model, ["cast:bf16"])
    for batch in (2, 3, 7):
        x = torch.randn(batch, 32)
        torch.testing.assert_close(run(x), model(x))
    x64 = torch.randn(2, 32, dtype=torch.float64)
    torch.testing.assert_close(run(x64), model(x64))


RECOMPILE_LIMIT_SCRIPT = """
import sys, torch, xform
sys.path.insert(0, sys.argv[1])
from models import mlp
model = mlp(32)
run = xform.compile(model, "cast:bf16", handoff="eager", dynamic=False)
with torch._dynamo.config.patch(recompile_limit=2):
    for batch in range(1, 6):
        x = torch.randn(batch, 32)
        torch.testing.assert_close(run(x), model(x))  # past the limit Dynamo runs the cast model eagerly
print(len(xform.report(model).graphs))
"""


def test_recompile_limit_is_a_clear_message_and_stays_correct():
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", RECOMPILE_LIMIT_SCRIPT, str(Path(__file__).parent)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "2"  # bounded by the limit
    assert "torch._dynamo hit config.recompile_limit (2)" in result.stderr


def test_a_second_instance_sharing_code_gets_its_own_transformed_weights():
    first, second = Block().eval(), Block().eval()
    run_first, run_second = compiled(first, ["cast:bf16"]), compiled(second, ["cast:bf16"])
    x = torch.randn(4, 8, 32)
    with torch.no_grad():
        a, b = run_first(x), run_second(x)
        torch.testing.assert_close(a, first(x))
        torch.testing.assert_close(b, second(x))
    assert first.fc.weight is not second.fc.weight and second.fc.weight.dtype == torch.bfloat16
