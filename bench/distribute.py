"""Distributed training on N GPUs: xform's distribute vs FSDP2 / DDP / tensor parallelism + torch.compile by hand.

    torchrun --nproc_per_node 8 bench/distribute.py --strategy fsdp [--layers 8 --dim 4096] [--out DIR]
    torchrun --nproc_per_node 8 bench/distribute.py --strategy fsdp+tp --tp-size 4

A llama-style decoder (bench/models.py), bf16, AdamW, each data-parallel rank a batch of `--batch`
sequences of `--seq` tokens (tensor-parallel ranks share theirs). Per configuration: median step
time (forward, backward, optimizer), tokens/s over all ranks, peak memory per rank. "by hand" is
`fully_shard` on every layer and the root (fsdp), `DistributedDataParallel` (ddp),
`parallelize_module` with the Megatron colwise/rowwise plan of every layer (tp; then `fully_shard`
over the data-parallel mesh dim for fsdp+tp), then `torch.compile`. Goal: xform >= 0.95x by hand.
By hand, `ColwiseParallel` cuts the fused k/v projection by contiguous rows (one rank k, the other
v): the same work and communication, timed as such, though not the same function; xform cuts it
as two blocks, by heads. `--device cpu` runs it with gloo, for a smoke test of the script itself.
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402
from models import Llama, LlamaConfig  # noqa: E402

import xform  # noqa: E402
from xform.transforms import Distribute  # noqa: E402


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(dim=args.dim, layers=args.layers, heads=args.dim // 128, kv_heads=args.dim // 128,
                         hidden=int(args.dim * 8 / 3) // 256 * 256, max_seq=args.seq)
    model = Llama(config).to(args.device)
    return model.bfloat16() if args.device == "cuda" else model


def mesh(args: argparse.Namespace) -> DeviceMesh:
    """(dp, tp) for fsdp+tp; one dim for the others."""
    world = dist.get_world_size()
    if args.strategy == "fsdp+tp":
        return init_device_mesh(args.device, (world // args.tp_size, args.tp_size), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(args.device, (world,), mesh_dim_names=("tp" if args.strategy == "tp" else "dp",))


def by_hand(model: torch.nn.Module, args: argparse.Namespace, device_mesh: DeviceMesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    if args.strategy == "ddp":
        return torch.compile(torch.nn.parallel.DistributedDataParallel(model))
    if "tp" in args.strategy:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"attention.wq": ColwiseParallel(), "attention.wkv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
        for layer in model.layers:
            layer.attention.heads //= device_mesh["tp"].size()  # the views inside see the local heads
            layer.attention.kv_heads //= device_mesh["tp"].size()
            parallelize_module(layer, device_mesh["tp"], plan)
    if "fsdp" in args.strategy:
        dp = device_mesh["dp"]
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return torch.compile(model)


def data_parallel(args: argparse.Namespace) -> int:
    world = dist.get_world_size()
    return {"tp": 1, "fsdp+tp": world // args.tp_size}.get(args.strategy, world)


def measure(way: str, args: argparse.Namespace, device_mesh: DeviceMesh) -> dict:
    model = build(args)
    if way == "xform":
        mesh_option = device_mesh if args.strategy != "ddp" else None
        compiled = xform.compile(model, Distribute(args.strategy, mesh=mesh_option))
    else:
        compiled = by_hand(model, args, device_mesh)
    tokens = torch.randint(0, 32000, (args.batch, args.seq), device=args.device)  # the same on every rank
    optimizer = None
    times = []
    cuda = args.device == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        synchronize()
        start = time.perf_counter()
        loss = compiled(tokens).float().logsumexp(-1).mean()
        loss.backward()
        if optimizer is None:  # after the first call: the parameters are the shards by then
            # tensor parallelism by hand leaves plain tensors (embedding, norms) beside DTensors,
            # which fused and foreach updates refuse to mix: both ways then step one tensor at a time
            fused = {"fused": True} if args.strategy != "tp" else {"foreach": False}
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    world = dist.get_world_size()
    return {"way": way, "strategy": args.strategy, "ranks": world, "step_ms": round(ms, 2),
            "tokens_per_s": round(args.batch * args.seq * data_parallel(args) / (ms / 1e3)),
            "peak_gib_per_rank": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "tp", "fsdp+tp"], default="fsdp")
    parser.add_argument("--tp-size", type=int, default=2, help="fsdp+tp: GPUs per tensor-parallel group")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("bench/distribute.py measures several GPUs: launch it with torchrun --nproc_per_node N (N >= 2)")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device_mesh = mesh(args)
    rows = [measure("by hand", args, device_mesh), measure("xform", args, device_mesh)]
    rows[1]["vs_by_hand"] = round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    if dist.get_rank() == 0:
        print_table(rows, ["way", "strategy", "ranks", "step_ms", "tokens_per_s", "peak_gib_per_rank", "vs_by_hand"])
        print("results:", write_result(f"distribute_{args.strategy}", rows, args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
