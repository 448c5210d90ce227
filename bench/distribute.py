"""Data-parallel and sharded training on N GPUs: xform's distribute vs FSDP2 / DDP + torch.compile by hand.

    torchrun --nproc_per_node 8 bench/distribute.py --strategy fsdp [--layers 8 --dim 4096] [--out DIR]

A llama-style decoder (bench/models.py), bf16, AdamW, each rank a batch of `--batch` sequences of
`--seq` tokens. Per configuration: median step time (forward, backward, optimizer), tokens/s over
all ranks, peak memory per rank. "by hand" is `fully_shard` on every layer and the root (fsdp) or
`DistributedDataParallel` (ddp), then `torch.compile`. Goal: xform >= 0.95x by hand.
Needs a multi-GPU machine (NCCL); rank 0 prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402
from models import Llama, LlamaConfig  # noqa: E402

import xform  # noqa: E402


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(dim=args.dim, layers=args.layers, heads=args.dim // 128, kv_heads=args.dim // 128,
                         hidden=int(args.dim * 8 / 3) // 256 * 256, max_seq=args.seq)
    return Llama(config).cuda().bfloat16()


def by_hand(model: torch.nn.Module, strategy: str) -> torch.nn.Module:
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return torch.compile(model)
    return torch.compile(torch.nn.parallel.DistributedDataParallel(model))


def measure(way: str, args: argparse.Namespace) -> dict:
    model = build(args)
    compiled = xform.compile(model, f"distribute:{args.strategy}") if way == "xform" else by_hand(model, args.strategy)
    tokens = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    optimizer = None
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = compiled(tokens).float().logsumexp(-1).mean()
        loss.backward()
        if optimizer is None:  # after the first call: the parameters are the shards by then
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    world = dist.get_world_size()
    return {"way": way, "strategy": args.strategy, "ranks": world, "step_ms": round(ms, 2),
            "tokens_per_s": round(args.batch * args.seq * world / (ms / 1e3)),
            "peak_gib_per_rank": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="fsdp")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("bench/distribute.py measures several GPUs: launch it with torchrun --nproc_per_node N (N >= 2)")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rows = [measure("by hand", args), measure("xform", args)]
    rows[1]["vs_by_hand"] = round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    if dist.get_rank() == 0:
        print_table(rows, ["way", "strategy", "ranks", "step_ms", "tokens_per_s", "peak_gib_per_rank", "vs_by_hand"])
        print("results:", write_result(f"distribute_{args.strategy}", rows, args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
