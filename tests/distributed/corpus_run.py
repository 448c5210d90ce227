"""The randomized corpus under `distribute`: each seeded model (tests/corpus.py) trained a few SGD
steps through `distribute:<strategy>` on every rank, against the same model trained eagerly in
this process; rank 0 writes what differed.

    torchrun --nproc_per_node 2 tests/distributed/corpus_run.py --strategies ddp,fsdp,tp --first 0 --models 8 --out r.json

Every rank sees the same batch, so data-parallel ranks average identical gradients and every
strategy must reproduce the one-process run: its outputs and input gradients at each step (after
the first, the outputs also check the parameters' gradients, through the updates they made).
`--with flex-attention` (or `cast:bf16`, ...) pairs each strategy with that transform; the one-process
run then has it too (compiled, as the other transforms left the model). `--with cudagraphs`
records on the simulated recorder (tests/simulated_recorder.py: the CPU as the recorded device, its
pool scribbled over before every replay), so the third step of each run is a replay.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from corpus import random_model  # noqa: E402
from simulated_recorder import SimulatedRecorder  # noqa: E402
from test_quantize import sqnr  # noqa: E402

import xform  # noqa: E402
import xform.transforms.cudagraphs.transform as cudagraphs  # noqa: E402
from xform.transforms import CudaGraphs  # noqa: E402

STEPS, LR = 3, 0.05
# how close to the one-process run: an allclose tolerance, or for float8 (scales of row-parallel
# activations taken over each rank's part of the features) a minimum SQNR in dB
TOLERANCE = {"": 1e-4, "flex-attention": 1e-4, "cudagraphs": 1e-4, "cast:bf16": 2e-2}  # bf16: partial sums rounded across ranks
MIN_DB = {"quantize:float8-rowwise": 20.0}
FIRST = ("cast:bf16", "quantize:float8-rowwise")  # they make the weights distribute shards: before it


def paired(name: str) -> list[str | CudaGraphs]:
    """The transform to pair with, fresh for each run: cudagraphs as an object, to count its replays."""
    if name == "cudagraphs":
        return [CudaGraphs()]
    return [name] if name else []


def differs(expected: torch.Tensor, got: torch.Tensor, paired: str) -> str | None:
    if paired in MIN_DB:
        db = sqnr(expected, got)
        return f"SQNR {db:.1f} dB < {MIN_DB[paired]}" if db < MIN_DB[paired] else None
    tolerance = TOLERANCE[paired]
    if torch.allclose(got, expected, atol=tolerance, rtol=10 * tolerance):
        return None
    return f"max |diff| {(got - expected).abs().max().item():.3g}"


def train(forward: Callable[[torch.Tensor], torch.Tensor], model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Per step of STEPS steps of SGD on the mean square of the output: the output and the input's
    gradient. The optimizer is made after the first call, when xform has replaced the parameters."""
    found, optimizer = [], None
    for step in range(STEPS):
        given = x.clone().requires_grad_(True)
        out = forward(given)
        if step == 0 and any(p.requires_grad for p in model.parameters()):
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        out.float().square().mean().backward()
        if optimizer is not None:
            optimizer.step()
        found.append(torch.cat([out.detach().float().flatten(), given.grad.float().flatten()]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,fsdp,tp")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--with", dest="paired", default="", choices=sorted({*TOLERANCE, *MIN_DB}),
                        help="a transform to pair every strategy with")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.paired == "cudagraphs":
        cudagraphs.available_recorder = SimulatedRecorder
    cases, replays, problems = 0, {}, []
    for seed in range(args.first, args.first + args.models):
        model, x = random_model(seed)
        reference = copy.deepcopy(model)
        expected = train(xform.compile(reference, *paired(args.paired), handoff="eager") if args.paired else reference,
                         reference, x)
        for strategy in args.strategies.split(","):
            torch._dynamo.reset()
            candidate = copy.deepcopy(model)
            transforms = [f"distribute:{strategy}", *paired(args.paired)]
            case = f"seed {seed} ({model.kinds}) distribute:{strategy}{'+' + args.paired if args.paired else ''}"
            cases += 1
            try:
                got = train(xform.compile(candidate, *(transforms[::-1] if args.paired in FIRST else transforms),
                                          handoff="eager"), candidate, x)
            except Exception as error:  # a crash is a finding too: recorded, and the sweep goes on
                problems.append(f"{case}: {type(error).__name__}: {str(error).strip().splitlines()[0][:300]}")
                continue
            replays[case] = sum(f.stats.replays for t in transforms if isinstance(t, CudaGraphs) for f in t.functions)
            for step, (e, a) in enumerate(zip(expected, got)):
                if (why := differs(e, a, args.paired)) is not None:
                    problems.append(f"{case}: step {step} output or input gradient: {why}")
                    break
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({"world": dist.get_world_size(), "cases": cases, "replays": replays if args.paired == "cudagraphs" else None,
                                              "problems": problems}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
