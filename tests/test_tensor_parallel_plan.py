"""Tensor parallelism's graph analysis (`xform.transforms.distribute.tp_plan`), on CPU in one process: which Linear layers
become column- and row-parallel, with which layout, and why the others stay replicated. The
multi-process runs that train with the resulting cuts are in test_distribute.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xform
from models import TiedLM, TransformerBlock
from xform._torch.dynamo import calling_module_path
from xform.transforms.distribute.tp_plan import plan_tensor_parallel
from xform.transforms.distribute.tp_rewrite import linear_refusal
from xform.transforms.distribute.tp_shardings import TensorParallelPlan, view_groups


class PlanProbe(xform.Transform):
    """Runs the analysis inside the pipeline (so parameters have their modules) and keeps the plan."""

    name = "plan-probe"

    def __init__(self, world: int) -> None:
        self.world = world
        self.plans: list[TensorParallelPlan] = []

    def transform_graph(self, graph, record):
        refusal = lambda n: linear_refusal(graph, n)  # noqa: E731
        self.plans.append(plan_tensor_parallel(graph.gm.graph, self.world, refusal, refusal))


def plan_of(model: nn.Module, *inputs: torch.Tensor, world: int = 2, transforms: tuple = ()) -> TensorParallelPlan:
    probe = PlanProbe(world)
    xform.compile(model, *transforms, probe, handoff="eager")(*inputs)
    assert len(probe.plans) == 1
    return probe.plans[0]


def layers(nodes) -> dict[str, object]:
    return {calling_module_path(n): v for n, v in nodes.items()}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaBlock(nn.Module):
    """Separate q/k/v with grouped-query attention, rotary embeddings, RMSNorm and a SwiGLU MLP."""

    def __init__(self, dim: int = 64, heads: int = 4, kv_heads: int = 2, hidden: int = 128) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class HandWrittenAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).permute(0, 2, 1, 3) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        weights = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, s, d))


def test_fused_qkv_is_cut_by_heads_and_the_mlp_by_hidden_features():
    plan = plan_of(nn.Sequential(TransformerBlock()), torch.randn(2, 8, 32))

    assert layers(plan.columns) == {"0.qkv": 3, "0.up": 1}  # qkv's rows: q, k, v blocks, each cut by heads
    assert layers(plan.rows) == {"0.proj": 1, "0.down": 1}
    assert plan.refused == {}
    assert {n.name for n in plan.size_args} == {"view", "reshape"}  # (b, s, 3, 4 heads, 8) and (b, s, 32)
    assert {n.name for n in plan.sum_gradient} == {"layer_norm", "layer_norm_1"}  # Megatron's f, once per input


def test_llama_block_with_grouped_query_attention_and_rotary_embeddings():
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    plan = plan_of(LlamaBlock(), torch.randn(2, 8, 64), cos, sin)

    assert sorted(layers(plan.columns)) == ["gate", "k", "q", "up", "v"]
    assert sorted(layers(plan.rows)) == ["down", "o"]
    assert plan.narrow == {}  # cos/sin broadcast over the heads: nothing to cut


class FusedKeyValue(nn.Module):
    """k and v from one Linear, viewed as (b, s, 2, kv_heads, head_dim) and unpacked (examples/llama.py's way)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wkv, self.wo = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.wq(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.wo(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


def test_a_split_that_n_divides_twice_is_cut_by_heads_after_trying_key_value():
    plan = plan_of(FusedKeyValue(), torch.randn(2, 8, 32))  # 2 ranks divide both the k/v pair and the heads

    assert layers(plan.columns) == {"wq": 1, "wkv": 2}  # wkv's rows: the k block and the v block, each by heads
    assert layers(plan.rows) == {"wo": 1}


def test_hand_written_attention():
    plan = plan_of(nn.Sequential(HandWrittenAttention()), torch.randn(2, 8, 32))

    assert sorted(layers(plan.columns)) == ["0.k", "0.q", "0.v"]
    assert layers(plan.rows) == {"0.out": 1}


def test_what_cannot_be_cut_stays_replicated_with_the_reason():
    plan = plan_of(nn.Sequential(TransformerBlock()), torch.randn(2, 8, 32), world=3)

    assert plan.columns == {} and plan.rows == {}
    reasons = layers(plan.refused)
    assert "node 'unbind' (unbind) splits along the sharded dimension (a fused projection split by q/k/v" in \
        reasons["0.qkv"]
    assert reasons["0.up"] == "node 'linear_3' (linear): its sharded dimension (128) does not divide by 3 ranks"


def test_an_output_layer_stays_replicated():
    head = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 10))
    plan = plan_of(head, torch.randn(4, 16))

    assert layers(plan.columns) == {"0": 1} and layers(plan.rows) == {"2": 1}
    assert layers(plan.refused) == {"3": "its sharded output reaches the graph's output"}


def test_a_reduction_over_the_features_is_not_carried():
    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            h = self.up(x)
            return self.down(h / h.sum(-1, keepdim=True))

    plan = plan_of(Pooled(), torch.randn(4, 16))
    assert plan.columns == {}
    assert layers(plan.refused)["up"] == "node 'sum_1' (sum) reduces over the sharded dimension"


def test_tied_and_quantized_weights_are_not_cut():
    tied = plan_of(TiedLM(), torch.randint(0, 50, (2, 8)))
    assert "shared, tied?" in layers(tied.refused)["head"]

    quantized = plan_of(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), torch.randn(4, 64),
                        transforms=("quantize:float8-weight-only",))
    assert all("another transform changed it, e.g. quantize" in r for r in quantized.refused.values())


def test_a_per_feature_scale_after_a_column_layer_is_cut_and_its_gradient_summed():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
            self.scale = nn.Parameter(torch.ones(32))

        def forward(self, x):
            return self.down(self.up(x) * self.scale)

    plan = plan_of(Scaled(), torch.randn(4, 16))
    assert layers(plan.columns) == {"up": 1}
    ((reader, slot), (dim, outer)), = plan.narrow.items()
    assert reader.name == "mul" and (dim, outer) == (0, 1)
    assert any(v.name == "l_self_parameters_scale_" for v in plan.sum_gradient)


@pytest.mark.parametrize("src, dst, groups", [
    ((2, 8, 96), (2, 8, 3, 4, 8), [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3, 4))]),
    ((2, 8, 4, 8), (2, 8, 32), [((0,), (0,)), ((1,), (1,)), ((2, 3), (2,))]),
    ((1, 8), (8,), [((0, 1), (0,))]),
    ((4, 8), (4, 8, 1), [((0,), (0,)), ((1,), (1,)), ((), (2,))]),
])
def test_view_groups(src, dst, groups):
    assert [(tuple(a), tuple(b)) for a, b in view_groups(src, dst)] == groups


def test_fewer_key_value_heads_than_ranks_leaves_attention_replicated_and_says_why():
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    plan = plan_of(LlamaBlock(heads=4, kv_heads=2), torch.randn(2, 8, 64), cos, sin, world=4)

    assert sorted(layers(plan.columns)) == ["gate", "up"]  # the MLP is still cut
    assert "attention needs query, key and value all sharded by heads" in layers(plan.refused)["q"]
