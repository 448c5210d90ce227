"""Compile-time overhead of xform with no transforms over plain Inductor (goal: <= 5%).

    python bench/compile_overhead.py [--repeats 5] [--out DIR]

For each model, alternately (ABBA order) compiles with backend="inductor" and backend="xform" from a clean
Dynamo state with Inductor's FX-graph and AOTAutograd caches off (so each compile is real), and
times the first forward+backward call. Also reports xform's own time inside the backend (all
but the handoff to Inductor), which is the overhead xform can be blamed for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402
from models import Llama, LlamaConfig  # noqa: E402

import xform  # noqa: E402


def models(device: str) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    mlp = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.GELU())]).to(device)
    llama = Llama(LlamaConfig(vocab=1024, dim=256, layers=4, heads=4, kv_heads=4, hidden=704, max_seq=128)).to(device)
    return {
        "mlp 4x1024": (mlp, torch.randn(64, 1024, device=device)),
        "llama 4 layers dim 256": (llama, torch.randint(0, 1024, (2, 128), device=device)),
    }


def first_step_seconds(model: nn.Module, x: torch.Tensor, backend: str) -> float:
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    compiled(x).float().sum().backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False

    rows = []
    chosen = models(device)
    bar = tqdm(total=len(chosen) * (1 + 2 * args.repeats), desc="first steps", unit="compile", disable=None)
    for name, (model, x) in chosen.items():
        first_step_seconds(model, x, "inductor")  # warm imports, kernel compile pools
        bar.update()
        times: dict[str, list[float]] = {"inductor": [], "xform": []}
        own: list[float] = []
        for repeat in range(args.repeats):
            order = ("inductor", "xform") if repeat % 2 == 0 else ("xform", "inductor")  # ABBA: no order bias
            for backend in order:
                seen = len(xform.report(model).graphs)
                times[backend].append(first_step_seconds(model, x, backend))
                if backend == "xform":
                    own.append(sum(g.xform_seconds for g in xform.report(model).graphs[seen:]))
                bar.update()
        inductor_s, xform_s = statistics.median(times["inductor"]), statistics.median(times["xform"])
        rows.append({
            "model": name, "device": device,
            "inductor_s": round(inductor_s, 3), "xform_s": round(xform_s, 3),
            "ratio": round(xform_s / inductor_s, 3),
            "xform_own_ms": round(statistics.median(own) * 1e3, 2),
            "xform_own_pct": round(100 * statistics.median(own) / inductor_s, 2),
        })
    bar.close()
    print_table(rows, ["model", "device", "inductor_s", "xform_s", "ratio", "xform_own_ms", "xform_own_pct"])
    print("results:", write_result("compile_overhead", rows, args.out, repeats=args.repeats))


if __name__ == "__main__":
    main()
