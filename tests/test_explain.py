"""`python -m xform explain` and `xform.explain(model, *args, transforms=...)`: what each transform
would do and every CUDA-graph break, without a GPU; and a bad target said with what to change."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import xform
from xform.__main__ import main

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''\
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.out = nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x).relu()
            if h.isnan().any():
                raise FloatingPointError("NaN")
            steps = torch.arange(16)
            return self.out(h) + steps.to(h.device)


    def make_model():
        return Net(), (torch.randn(4, 16),)


    def make_eval_model():
        return Net().eval(), (torch.randn(4, 16),), {}


    def only_a_model():
        return Net()


    def args_not_a_tuple():
        return Net(), torch.randn(4, 16)


    class OnCuda(nn.Module):
        def forward(self, x):
            return x.cuda() * 2


    def make_cuda_model():
        return OnCuda(), (torch.randn(4, 16),)


    class NewTensor(nn.Module):
        def forward(self, x):
            return torch.cat([torch.tensor([1.0], device=x.device), x.flatten()])


    def make_new_tensor_model():
        return NewTensor(), (torch.randn(4, 16),)


    WIDTH = 16
''')


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if text in line)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xform", "explain", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "netscript.py"
    path.write_text(SCRIPT)
    return path


def test_explain_names_each_break_with_the_users_line_the_reason_and_the_fix(script):
    result = run_cli(f"{script}:make_model", cwd=script.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "model: Net (train mode, 544 parameters), called with (tensor[4, 16] float32)" in out
    assert "transforms: quantize:float8-rowwise, flex-attention, distribute:fsdp, cudagraphs (the defaults" in out
    # pass 1: the report of the transforms, on the CPU
    assert "Linear -> ContiguousInputFloat8Linear (float8-rowwise)" in out
    assert "single process (WORLD_SIZE 1, no process group): nothing to distribute" in out
    # pass 2: the CUDA-graph breaks, each with its line, reason and fix, said of CUDA
    arange = line_of("steps = torch.arange(16)")
    assert f"not changed: torch.arange (node steps) at netscript.py:{arange} in forward: steps = torch.arange(16)" in out
    assert "it runs on the CPU: its result is a cpu tensor, and a CUDA graph records cuda work only. Fix:" in out
    copy = line_of("steps.to(h.device)")
    assert f"at netscript.py:{copy} in forward: return self.out(h) + steps.to(h.device)" in out
    assert f"graph 1/0 (Net.forward (resumed after the graph break at netscript.py:{line_of('isnan')}))" in out
    assert "meta" not in out.split("== cudagraphs")[1]  # the stand-in device is never named
    assert out.rstrip().endswith("2 region break(s); 2 region(s) would be recorded as CUDA graphs, over 2 Dynamo "
                                 "graph(s)")


def test_a_module_target_and_chosen_transforms(script):
    result = run_cli("netscript:make_eval_model", "--transforms", "cast:bf16", cwd=script.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model: Net (eval mode, 544 parameters)" in result.stdout
    assert "transforms: cast:bf16\n" in result.stdout
    assert "float32 -> bfloat16" in result.stdout
    assert "== cudagraphs" not in result.stdout


def test_the_defaults_follow_the_models_mode():
    from torch import nn

    from xform.explainer import default_transforms

    model = nn.Linear(4, 4)
    assert default_transforms(model) == ["quantize:float8-rowwise", "flex-attention", "distribute:fsdp", "cudagraphs"]
    assert default_transforms(model.eval()) == ["quantize:float8-weight-only", "flex-attention", "cudagraphs"]
    assert default_transforms(model.train().requires_grad_(False))[0] == "quantize:float8-weight-only"


# --- from Python ---------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.fc(x)
        return h * scale + torch.arange(16).to(h.device)


def test_explain_from_python_gives_both_reports_and_leaves_the_model_as_it_was():
    model = Block().eval()
    weight = model.fc.weight
    found = xform.explain(model, torch.randn(4, 16), transforms=["cast:bf16", "cudagraphs"], scale=2.0)
    assert isinstance(found, xform.Explanation)
    assert [(c.target, c.detail.split(",")[0]) for c in found.transforms.changes("cast") if c.target == "fc"] == \
        [("fc", "float32 -> bfloat16")]
    breaks = [s for s in found.cuda_graphs.skips("cudagraphs") if "torch.arange" in s.target]
    assert breaks and "a CUDA graph records cuda work only" in breaks[0].reason
    text = str(found)
    assert text.startswith("xform explain Block\nmodel: Block (eval mode, 272 parameters), called with "
                           "(tensor[4, 16] float32, scale=float)\ntransforms: cast:bf16, cudagraphs\n")
    assert "2 region break(s)" in text  # torch.arange and its copy to the device
    assert model.fc.weight is weight and weight.dtype == torch.float32 and weight.device.type == "cpu"


def test_explain_from_python_takes_a_comma_separated_spec_and_defaults_to_the_models_mode():
    only_cast = xform.explain(Block(), torch.randn(4, 16), transforms="cast:bf16")
    assert only_cast.cuda_graphs is None and only_cast.transforms.changes("cast")
    defaults = xform.explain(Block().eval(), torch.randn(4, 16))
    assert "(the defaults for this mode; transforms= to choose)" in defaults.sections[0]


def test_explain_from_python_says_what_it_takes():
    with pytest.raises(ValueError, match=r"^xform.explain takes the model \(an nn.Module\) first, then its inputs, not "
                                         r"a Tensor: xform.explain\(model, \*args, transforms=\[...\], \*\*kwargs\)$"):
        xform.explain(torch.randn(4, 16), Block())
    with pytest.raises(ValueError, match="^xform: unknown transform .cudagraph. in spec .cudagraph.; accepted: "):
        xform.explain(Block(), torch.randn(4, 16), transforms=["cudagraph"])
    with pytest.raises(ValueError, match=r"^xform.explain takes transforms as spec strings \(\['cast:bf16', "
                                         r"'cudagraphs'\] or 'cast:bf16,cudagraphs'\), not \['Cast'\]$"):
        xform.explain(Block(), torch.randn(4, 16), transforms=[xform.transforms.Cast()])


# --- a bad target, said with what to change ----------------------------------------------------


def explain_error(capsys, *argv: str, header: bool = False) -> str:
    """The message of a failing explain; before it, only the header (model, transforms) if `header`."""
    assert main(["explain", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("xform explain ") if header else captured.out == ""
    return captured.err.strip()


def test_a_missing_file(capsys, tmp_path):
    err = explain_error(capsys, f"{tmp_path}/nowhere.py:make_model")
    assert err.startswith(f"xform explain: no file '{tmp_path}/nowhere.py' (looked in ")
    assert err.endswith("give the script's path, relative to the current directory or absolute")


def test_a_missing_module(capsys):
    err = explain_error(capsys, "no_such_package.models:make_model")
    assert err == ("xform explain: cannot import module 'no_such_package.models' (No module named 'no_such_package'); "
                   "is it installed, in the current directory or on PYTHONPATH? A script is named by its path: "
                   "path/to/no_such_package.models.py:FUNCTION")


def test_a_target_without_a_function(capsys):
    err = explain_error(capsys, "netscript.py")
    assert err == ("xform explain: target 'netscript.py' must be SCRIPT.py:FUNCTION or MODULE:FUNCTION, e.g. "
                   "examples/llama_train.py:make_model")


def test_a_missing_attribute_lists_what_the_script_defines(capsys, script):
    err = explain_error(capsys, f"{script}:make_modle")
    assert err == (f"xform explain: {script} has no attribute 'make_modle'; it defines: Net, NewTensor, OnCuda, "
                   f"args_not_a_tuple, make_cuda_model, make_eval_model, make_model, make_new_tensor_model, "
                   f"only_a_model")


def test_an_attribute_that_is_no_function(capsys, script):
    err = explain_error(capsys, f"{script}:WIDTH")
    assert err.startswith(f"xform explain: {script}:WIDTH is a int, not a function: point at a function of no argument; "
                          f"it must return (model, args) or (model, args, kwargs)")


@pytest.mark.parametrize(("function", "message"), [
    ("only_a_model", "only_a_model() returned a Net; it must return (model, args) or (model, args, kwargs): model an "
                     "nn.Module, args a tuple of example inputs, kwargs a dict, so that model(*args, **kwargs) is one "
                     "call"),
    ("args_not_a_tuple", "args_not_a_tuple() returned a tuple of 2 (Net, Tensor): its args are a Tensor, not a tuple "
                         "(one input x is written (x,)); it must return (model, args)"),
    ("Net", "Net() returned a Net; it must return (model, args)"),
])
def test_a_function_returning_the_wrong_thing(capsys, script, function, message):
    err = explain_error(capsys, f"{script}:{function}")
    assert err.startswith(f"xform explain: {script}:{message}")


def test_an_unknown_transform(capsys, script):
    err = explain_error(capsys, f"{script}:make_model", "--transforms", "cast:bf16,cudagraph")
    assert err.startswith("xform explain: xform: unknown transform 'cudagraph' in spec 'cudagraph'; accepted: ")


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="the message is for a PyTorch built without CUDA")
def test_a_model_asking_for_cuda_by_name(capsys, script):
    err = explain_error(capsys, f"{script}:make_cuda_model", "--transforms", "cudagraphs", header=True)
    assert err == ("xform explain: the model puts a tensor on CUDA by name (.cuda(), .to('cuda'), device='cuda'), "
                   "which this PyTorch, built without CUDA, cannot do even for a trace: make the model follow its "
                   "inputs (device=x.device in the forward, model.to(device) outside it)")


def test_a_trace_the_stand_in_device_cannot_run_keeps_the_sections_before_it(capsys, script):
    assert main(["explain", f"{script}:make_new_tensor_model", "--transforms", "cast:bf16,cudagraphs"]) == 2
    captured = capsys.readouterr()
    assert "== cast:bf16: one call on the CPU" in captured.out and "xform report: 1 graph(s)" in captured.out
    assert captured.err.startswith("xform explain: the CUDA-graph trace failed on CUDA's stand-in (PyTorch's meta "
                                   "device): TorchRuntimeError: ")
    assert captured.err.strip().endswith("Dynamo keeps torch.tensor(data, device=x.device) as a plain meta tensor, as "
                                         "in transformers' KV cache (pass use_cache=False). The sections above are "
                                         "complete")
