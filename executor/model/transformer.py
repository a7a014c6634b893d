"""A plain Llama-family transformer: RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU.

It covers Llama 2/3, Mistral, Qwen2 (qkv bias, tied embeddings) and Qwen3 (qk-norm). It knows nothing of plans:
functions in `apply.py` wrap its parts for recompute and compilation. The q/k/v projections are one matmul, and so
are gate and up: fewer, larger GEMMs. Build it on the meta device, then `materialize` it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastml.executor.model import fused
from fastml.executor.model.loss import lm_loss_sum
from fastml.plan import layer_of
from fastml.spec import ModelSpec, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU(nn.Module):
    """silu(gate) * up, with gate and up side by side in the last dim of one tensor: one fused op (fused.py) that
    keeps only its input for the backward pass."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused.swiglu(gate_up)


class RotaryAttention(nn.Module):
    """Rotary position embedding and causal scaled-dot-product attention over projected q, k, v."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # (B, T, H, D)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2).flatten(2)  # (B, T, H*D)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.qkv = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps) if spec.qk_norm else None
        self.core = RotaryAttention()
        self.out = nn.Linear(spec.q_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = self.spec
        q, k, v = self.qkv(x).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.unflatten(-1, (s.num_heads, s.head_dim))  # (B, T, Hq, D)
        k = k.unflatten(-1, (s.num_kv_heads, s.head_dim))  # (B, T, Hkv, D)
        v = v.unflatten(-1, (s.num_kv_heads, s.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.out(self.core(q, k, v, cos, sin))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up = nn.Linear(spec.hidden_size, 2 * spec.ffn_hidden_size, bias=False)
        self.act = SwiGLU()
        self.down = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.ffn = FeedForward(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        # A tied LM head reads the embedding matrix; there is no second parameter to keep in sync.
        self.lm_head = None if spec.tied_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, h) of token ids (B, T)."""
        x = self.embed(tokens)
        cos, sin = rotary_tables(self.spec, tokens.shape[1], x.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self(tokens), self.lm_head_weight)  # (B, T, V)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, num_chunks: int = 1) -> torch.Tensor:
        """Mean next-token cross-entropy. The LM head and loss run over `num_chunks` slices of the tokens, their
        gradients made as they go (loss.py), so the (tokens x vocab) logits exist a slice at a time."""
        hidden = self(tokens).flatten(0, 1)  # (B*T, h)
        targets = targets.flatten()
        return lm_loss_sum(hidden, self.lm_head_weight, targets, num_chunks) / targets.numel()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        for name, p in self.named_parameters():
            self.init_parameter(name, p, generator)

    @torch.no_grad()
    def init_parameter(self, name: str, p: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Normal(0, 0.02) matrices, residual projections scaled by 1/sqrt(2L) (GPT-2); ones for norms. Called in
        parameter order, so that one generator gives the same weights however they are placed."""
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            scale = 1 / math.sqrt(2 * self.spec.num_layers) if name.endswith(("out.weight", "down.weight")) else 1
            p.normal_(0.0, 0.02 * scale, generator=generator)


def rotary_tables(spec: ModelSpec, seq_len: int, device: torch.device, dtype: torch.dtype):
    """cos and sin (T, D) for positions 0..T-1, in the half-split layout of HF's `rotate_half`."""
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, device=device, dtype=torch.float32)
                                         / spec.head_dim)
    if spec.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, spec.rope_scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3 RoPE scaling (Meta's llama3 reference, `apply_scaling`): long wavelengths are slowed by `factor`,
    short ones kept, and those between blended linearly in 1/wavelength."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    low_freq = wavelen > s.original_max_seq_len / s.low_freq_factor
    high_freq = wavelen < s.original_max_seq_len / s.high_freq_factor
    return torch.where(low_freq, inv_freq / s.factor, torch.where(high_freq, inv_freq, blended))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) rotated by position; cos, sin (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def layer_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The trainable parameters by name, grouped as `fastml.plan.layer_of` groups them, in model order: `embed`, the
    blocks, then `head`."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(layer_of(name), []).append((name, p))
    return groups


def build_model(spec: ModelSpec) -> Transformer:
    """The model with its parameters on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(spec)


def materialize(model: Transformer, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
                keep=None) -> Transformer:
    """Allocates a meta model's parameters on `device` in `dtype` and initializes them from `seed`. With `keep`,
    parameter by parameter: `keep(name, p)` returns where each initialized parameter lives from then on (host
    memory for offloaded ones), so that a model larger than the GPU never sits on it whole."""
    model.to(dtype)  # still on meta: costs nothing, and memory is allocated once, in the final dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    if keep is None:
        model.to_empty(device=device)
        model.init_weights(generator)
        return model
    model.to_empty(device="cpu")  # dense, so that `.data` may take tensors of any device; no page is touched
    for name, p in model.named_parameters():
        p.data = torch.empty_like(p, device=device)
        model.init_parameter(name, p, generator)
        p.data = keep(name, p)
    return model
