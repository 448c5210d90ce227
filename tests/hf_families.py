"""Hugging Face model families at small sizes with random weights (built from their configs: nothing
is downloaded), their inputs, and how a compiled run is compared with an eager one: shared by
test_hf_models.py and the conformance suite (test_conformance.py).

Every family: hidden size 64, 2 layers, 4 heads, vocabulary 128, sequences of 16, dropout off (so
that eager and compiled training compute the same thing). What each brings: Mistral a sliding
window (8) shorter than the sequence; Gemma 2 a soft-cap and alternating sliding-window layers;
Gemma 3 alternating sliding and full layers under SDPA, with its own score scale;
Mixtral experts (4, two a token); GPT-2 Conv1D layers and a tied head; BERT an encoder (masked LM,
tied head); T5 an encoder-decoder with a relative position bias; ViT images (32x32, patches of 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, LAYERS, HIDDEN = 128, 16, 2, 64
IMAGE, PATCH, LABELS = 32, 8, 10
_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def llama(attention: str = "sdpa") -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER, attn_implementation=attention))


def mistral(attention: str = "sdpa") -> torch.nn.Module:
    """Its sliding window (8) is shorter than the sequence, so the window masks."""
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_DECODER, sliding_window=8,
                                                                      attn_implementation=attention))


def qwen2(attention: str = "sdpa") -> torch.nn.Module:
    """Biases on q, k and v."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_DECODER, attn_implementation=attention))


def gemma2(attention: str = "eager") -> torch.nn.Module:
    """Scores soft-capped (`50 * tanh(s / 50)`), logits too; every other layer a sliding window of 8.
    Its attention written out (HF's sdpa drops the soft-cap, and transformers 5.25 refuses it)."""
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_DECODER, head_dim=16, sliding_window=8,
                                                                    attn_implementation=attention))


def gemma3(attention: str = "sdpa") -> torch.nn.Module:
    """Layers alternating a sliding window of 8 and full attention (two kinds of cache layer in
    generate()), q and k normalized per head, scores scaled by query_pre_attn_scalar ** -0.5 (256),
    not by the head dim's."""
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **_DECODER, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        attn_implementation=attention))


def mixtral(attention: str = "sdpa") -> torch.nn.Module:
    """Four experts, two a token."""
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2, attn_implementation=attention))


def gpt2(attention: str = "sdpa") -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation=attention))


def bert(attention: str = "sdpa") -> torch.nn.Module:
    """A masked LM, its decoder tied to the word embeddings."""
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=attention))


def t5(attention: str = "sdpa") -> torch.nn.Module:
    """Encoder and decoder of 2 layers each, the head tied to the shared embedding."""
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=LAYERS, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation=attention))


def vit(attention: str = "sdpa") -> torch.nn.Module:
    """Image classification: 16 patches and the class token."""
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_labels=LABELS, attn_implementation=attention))


FAMILIES: dict[str, Callable[..., torch.nn.Module]] = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "gemma2": gemma2, "gemma3": gemma3, "mixtral": mixtral,
    "gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit}
GENERATING = ("llama", "mistral", "qwen2", "gemma2", "gemma3", "mixtral", "gpt2", "t5")  # the families that generate() text


def batch(family: str, train: bool, padded: bool = False) -> dict[str, torch.Tensor]:
    """Two examples of `family`'s input, with the labels of a training step; `padded`: the second
    sequence left-padded by 5 (HF then builds a padding mask)."""
    generator = torch.Generator().manual_seed(1)
    if family == "vit":
        images = {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=generator)}
        return {**images, "labels": torch.tensor([1, 7])} if train else images
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if family == "t5":  # the decoder reads the targets shifted right (HF shifts labels itself)
        targets = ids.flip(1)[:, :10].contiguous()
        inputs["decoder_input_ids" if not train else "labels"] = targets
    elif train:
        inputs["labels"] = ids
    return inputs


@dataclass
class Outputs:
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal to quantization noise, in dB, of `actual` against `reference` (inf where they are equal)."""
    reference, actual = reference.float(), actual.float()
    error = (reference - actual).norm()
    return float("inf") if error == 0 else (20 * torch.log10(reference.norm() / error)).item()


def run(model: torch.nn.Module, inputs: dict[str, torch.Tensor], train: bool, call: Any = None) -> Outputs:
    """Logits, and for training each parameter's gradient, of one call of `call` (default: the model)."""
    call = model if call is None else call
    extra = {} if "pixel_values" in inputs else {"use_cache": False}
    if not train:
        with torch.no_grad():
            return Outputs(call(**inputs, **extra).logits, {})
    out = call(**inputs, **extra)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return Outputs(out.logits.detach(), grads)


# of the largest gradient's norm: a vanishing one in eager (measured 2e-10 at most: ViT's key biases)
# and what it may be compiled (measured 2.2e-6, with cast:bf16)
VANISHING, NEGLIGIBLE = 1e-8, 1e-4


def worst_grad_sqnr(eager: Outputs, compiled: Outputs) -> float:
    """The lowest SQNR over the parameters' gradients (every parameter with one in eager has one
    compiled). A gradient that is zero in exact arithmetic (a key projection's bias: softmax does not
    change when a row's scores all grow alike) is rounding noise in both, so it is not compared but
    must stay negligible: below VANISHING in eager, below NEGLIGIBLE compiled, of the largest norm."""
    assert eager.grads.keys() == compiled.grads.keys() and eager.grads
    largest = max(g.norm() for g in eager.grads.values())
    vanishing = {n for n, g in eager.grads.items() if g.norm() < VANISHING * largest}
    assert all(compiled.grads[n].norm() < NEGLIGIBLE * largest for n in vanishing), vanishing
    return min(sqnr(eager.grads[n], compiled.grads[n]) for n in eager.grads if n not in vanishing)


# --- what the transforms leave as written, in the report's words --------------------------------

CONV1D = ("it is a Conv1D, not an nn.Linear: it computes torch.addmm with its weight, and only nn.Linear layers "
          "(F.linear calls) are changed; left as written. Replace it by an nn.Linear (its weight transposed) to "
          "change it")
EXPERTS = ("it is a stack of 4 weight matrices (", "multiplies by, not an nn.Linear: only nn.Linear layers are "
           "changed; left as written. Hold each matrix as an nn.Linear to change it")


def tied(owner: str, kind: str) -> str:
    """Why a head sharing its weight with the embedding `owner` (of class `kind`) is left as written."""
    return (f"its weight is {owner}.weight, shared with {owner} ({kind}, tied weights); changing it would change "
            f"that module too. Untie the weights to change it")


def router(kind: str) -> str:
    return (f"it is a {kind}, not an nn.Linear: it calls F.linear with its own weight, and only nn.Linear layers "
            f"are changed; left as written")


def weight_skips(family: str) -> dict[str, tuple[str, str]]:
    """Layer -> (start, end) of the reason cast and quantize give for leaving it as written."""
    layers = range(LAYERS)
    if family == "gpt2":
        conv1d = {f"transformer.h.{i}.{m}": (CONV1D, "") for i in layers
                  for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
        return {"lm_head": (tied("transformer.wte", "Embedding"), ""), **conv1d}
    if family == "mixtral":
        return {**{f"model.layers.{i}.mlp.gate": (router("MixtralTopKRouter"), "") for i in layers},
                **{f"model.layers.{i}.mlp.experts.{w}": EXPERTS for i in layers for w in ("gate_up_proj", "down_proj")}}
    heads = {"gemma2": ("lm_head", "model.embed_tokens", "Gemma2TextScaledWordEmbedding"),
             "gemma3": ("lm_head", "model.embed_tokens", "Gemma3TextScaledWordEmbedding"),
             "bert": ("cls.predictions.decoder", "bert.embeddings.word_embeddings", "Embedding"),
             "t5": ("lm_head", "encoder.embed_tokens", "Embedding")}
    if family in heads:
        head, owner, kind = heads[family]
        return {head: (tied(owner, kind), "")}
    return {}
