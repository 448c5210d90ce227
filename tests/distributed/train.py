"""Train a small transformer for a few steps under torchrun; rank 0 writes what the tests compare.

    torchrun --nproc_per_node 2 tests/distributed/train.py --way xform --strategy fsdp --out result.json

--way: "xform" (xform.compile with distribute:<strategy>), "single" (one process, no distribution),
"ddp" (torch DDP by hand), "fsdp2" (torch FSDP2 fully_shard by hand). Every way sees the same
global batch each step; each data-parallel rank takes its slice of it (tensor-parallel ranks share
theirs), so all ways compute the same losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import TransformerBlock  # noqa: E402

from bench.models import Llama, LlamaConfig  # noqa: E402

import xform  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads=4) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--way", choices=["xform", "single", "ddp", "fsdp2"], required=True)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--handoff", default="eager")
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", choices=["tiny", "llama"], default="tiny",
                        help="llama: bench's decoder, small (grouped-query attention, rotary, SwiGLU, fused k/v)")
    parser.add_argument("--tp-size", type=int, default=None, help="fsdp+tp: ranks per tensor-parallel group")
    parser.add_argument("--flex", action="store_true", help="also flex-attention (after distribute)")
    parser.add_argument("--vary-batch", action="store_true", help="odd steps take half the batch (a recompile)")
    parser.add_argument("--eval-batch", type=int, default=0, help="then run eval at this batch size (a recompile)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1")) if args.way != "single" else 1
    if args.way in ("ddp", "fsdp2"):
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLM() if args.model == "tiny" else Llama(LlamaConfig(vocab=64, dim=64, layers=2, heads=4, kv_heads=2,
                                                                    hidden=128, max_seq=16))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 64, (args.steps, 8, 16))
    targets = torch.randint(0, 64, (args.steps, 8, 16))

    if args.way == "xform":
        distribute = xform.transforms.Distribute(args.strategy, tp_size=args.tp_size)
        transforms = ([f"quantize:{args.quantize}"] if args.quantize else []) + [distribute]
        step_model = xform.compile(model, *transforms, *(["flex-attention"] if args.flex else []), handoff=args.handoff)
    elif args.way == "ddp":
        step_model = nn.parallel.DistributedDataParallel(model)
    elif args.way == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        step_model = model
    else:
        step_model = model
    rank = int(os.environ.get("RANK", "0"))  # torchrun's; xform initializes the process group itself

    data_parallel = _data_parallel_ranks(args, world)

    def local(batch: torch.Tensor) -> torch.Tensor:
        return batch.chunk(data_parallel)[rank // (world // data_parallel)]

    losses, optimizer = [], None
    for step in range(args.steps):
        size = tokens.shape[1] // 2 if args.vary_batch and step % 2 else tokens.shape[1]
        logits = step_model(local(tokens[step][:size]))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), local(targets[step][:size]).flatten())
        if optimizer is None:  # after the first call: xform has replaced the parameters by then
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())

    eval_logits = None
    if args.eval_batch:  # another batch size: Dynamo recompiles the sharded model
        with torch.no_grad():
            eval_logits = step_model(tokens[0][:args.eval_batch]).sum().item()

    local_bytes = sum(p.untyped_storage().nbytes() if not hasattr(p, "to_local") else p.to_local().nbytes
                      for p in model.parameters())
    all_bytes = [local_bytes]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local_bytes)
        all_bytes = gathered
    state = model.state_dict() if args.way != "fsdp2" else {}
    full_shapes = all(tuple(state[k].shape) == tuple(v.shape) for k, v in initial.items()) if state else None
    reloaded = None
    if args.way == "xform" and state:
        model.load_state_dict(initial)  # full tensors back in: each rank takes its shard
        reloaded = all(torch.equal(model.state_dict()[k], v) for k, v in initial.items())
    if rank == 0:
        report = xform.report(model) if args.way == "xform" else None
        args.out.write_text(json.dumps({
            "losses": losses, "param_bytes": all_bytes, "world": world,
            "state_dict_full_shapes": full_shapes, "reloaded": reloaded,
            "notes": report.notes() if report else [],
            "changes": len(report.changes("distribute")) if report else 0,
            "skips": [[s.target, s.reason] for s in report.skips("distribute")] if report else [],
            "attention_changes": len(report.changes("flex-attention")) if report else 0,
            "graphs": len(report.graphs) if report else 0,
            "eval_logits_sum": eval_logits,
        }))
    if dist.is_initialized():
        del step_model  # DDP's reducer must go before its process group (torch 2.11 aborts otherwise)
        dist.barrier()
        dist.destroy_process_group()
        # Everything is written. Leave now: torch 2.13's FSDP2 (by hand) left a thread joinable
        # at interpreter exit in about 1 run in 6 on this CPU ('terminate called without an active
        # exception', SIGABRT after the results were written), which is torch's teardown, not a result.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _data_parallel_ranks(args: argparse.Namespace, world: int) -> int:
    """How many different slices of the batch the ranks take (tensor-parallel ranks share one)."""
    if args.way != "xform" or "tp" not in args.strategy:
        return world
    return world // (args.tp_size or 2) if args.strategy == "fsdp+tp" else 1


if __name__ == "__main__":
    main()
