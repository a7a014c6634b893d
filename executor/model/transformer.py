"""A plain Llama-family transformer: RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU.

It covers Llama 2/3, Mistral, Qwen2 (qkv bias, tied embeddings) and Qwen3 (qk-norm). It knows nothing of plans:
functions in `apply.py` wrap its parts for recompute and compilation. The q/k/v projections are one matmul, and so
are gate and up: fewer, larger GEMMs. Build it on the meta device, then `materialize` it.

Under tensor parallelism (parallel/tensor.py) each rank builds the same model with its share of the heads, of the
FFN's width and of the vocabulary, and the blocks call the group's collectives where a slice meets the whole; without
it those calls return what they are given.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastml.executor.model import fused
from fastml.executor.model.loss import lm_loss_sum
from fastml.executor.parallel.pipeline import PipelineParallel
from fastml.executor.parallel.tensor import TensorParallel
from fastml.plan import layer_of, tensor_slice
from fastml.spec import ModelSpec, RopeScaling


class RMSNorm(nn.Module):
    """`tp` where each rank of a tensor-parallel group normalizes part of the activations (a slice of the sequence,
    its own heads): the weight's gradient is summed over the group."""

    def __init__(self, dim: int, eps: float, tp: TensorParallel | None = None):
        super().__init__()
        self.eps, self.tp = eps, tp
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.tp is None else self.tp.shared_weight(self.weight)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


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
    """`spec`: the model as this rank computes it, its heads alone under tensor parallelism (`tp`)."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.qkv = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        norm_tp = tp if tp.active else None
        self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps, norm_tp) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps, norm_tp) if spec.qk_norm else None
        self.core = RotaryAttention()
        self.out = nn.Linear(spec.q_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = self.spec
        q, k, v = self.qkv(self.tp.enter(x)).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.unflatten(-1, (s.num_heads, s.head_dim))  # (B, T, Hq, D)
        k = k.unflatten(-1, (s.num_kv_heads, s.head_dim))  # (B, T, Hkv, D)
        v = v.unflatten(-1, (s.num_kv_heads, s.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.tp.leave(self.out(self.core(q, k, v, cos, sin)))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate_up = nn.Linear(spec.hidden_size, 2 * spec.ffn_hidden_size, bias=False)
        self.act = SwiGLU()
        self.down = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.leave(self.down(self.act(self.gate_up(self.tp.enter(x)))))


class Embedding(nn.Embedding):
    """Under tensor parallelism, this rank's rows of the vocabulary, the lookups summed over the group (a module all
    the same, so that what hooks the embedding, the placement's fetch of sharded weights, sees it run)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__(vocab_size, hidden_size)
        self.tp = tp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tp.embed(tokens, self.weight) if self.tp.active else super().forward(tokens)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel):
        super().__init__()
        norm_tp = tp if tp.sequence else None  # each rank normalizes its slice of the sequence
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps, norm_tp)
        self.attn = Attention(spec, tp)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps, norm_tp)
        self.ffn = FeedForward(spec, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class HeldElsewhere(nn.Module):
    """The place of a block another pipeline stage holds: no parameters here, and nothing to run."""

    def forward(self, *args):
        raise RuntimeError("this block is held by another pipeline stage")


class Transformer(nn.Module):
    """`spec`: the whole model; `tp`: this rank's place in a tensor-parallel group, which decides its slice; `pp` its
    place in a pipeline, which decides its blocks (the others are `HeldElsewhere`, so that every parameter keeps its
    name): the embedding on the first stage (and the last, where tied to the LM head), the final norm and LM head on
    the last."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None, pp: PipelineParallel | None = None):
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TensorParallel(spec)
        self.pp = pp = pp or PipelineParallel(spec.num_layers)
        mine = tensor_slice(spec, tp.size)
        held = pp.held_blocks
        self.embed = Embedding(mine.vocab_size, spec.hidden_size, tp) \
            if pp.first or (pp.last and spec.tied_embeddings) else None
        self.blocks = nn.ModuleList(Block(mine, tp) if i in held else HeldElsewhere() for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, tp if tp.sequence else None) if pp.last else None
        # A tied LM head reads the embedding matrix; there is no second parameter to keep in sync.
        self.lm_head = None if spec.tied_embeddings or not pp.last else \
            nn.Linear(spec.hidden_size, mine.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype as the model computes: the one `materialize` gave them (a block whose fp32 masters are
        streamed, knobs.stream_masters, points at them between uses, and may be a pipeline stage's first parameter),
        else its first parameter's."""
        return getattr(self, "materialized_dtype", None) or next(self.parameters()).dtype

    def held_blocks(self) -> list[tuple[int, Block]]:
        """(index, block) of the blocks this rank holds: all of them but under pipeline parallelism."""
        return [(i, block) for i, block in enumerate(self.blocks) if not isinstance(block, HeldElsewhere)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, h) of token ids (B, T)."""
        return self.tp.enter(self.norm(self.trunk(tokens)))  # whole on every rank, for the LM head's vocabulary slices

    def trunk(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding and every block: the residual stream before the final norm."""
        return self.run_blocks(self.embed(tokens), range(len(self.blocks)))

    def stage(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Pipeline stage `index`'s blocks over its input: the tokens for the first, the stage before's output for the
        others."""
        return self.run_blocks(self.embed(x) if index == 0 else x, self.pp.blocks_of(index))

    def run_blocks(self, x: torch.Tensor, indices: range) -> torch.Tensor:
        seq_len = x.shape[1] * self.tp.size if self.tp.sequence else x.shape[1]  # a slice under sequence parallelism
        cos, sin = rotary_tables(self.spec, seq_len, x.device, x.dtype)
        for i in indices:
            x = self.blocks[i](x, cos, sin)
        return x

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T, V), or under tensor parallelism this rank's slice of the vocabulary."""
        return F.linear(self(tokens), self.lm_head_weight)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, num_chunks: int = 1) -> torch.Tensor:
        """Mean next-token cross-entropy. The LM head and loss run over `num_chunks` slices of the tokens, their
        gradients made as they go (loss.py), so the (tokens x vocab) logits exist a slice at a time."""
        return self.head_loss(self.trunk(tokens), targets, num_chunks)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, num_chunks: int = 1) -> torch.Tensor:
        """The mean cross-entropy of the residual stream `x` after the last block: the final norm, the LM head, the
        loss."""
        hidden = self.tp.enter(self.norm(x)).flatten(0, 1)  # (B*T, h)
        targets = targets.flatten()
        tp = self.tp if self.tp.active else None
        return lm_loss_sum(hidden, self.lm_head_weight, targets, num_chunks, tp) / targets.numel()

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


def build_model(spec: ModelSpec, tp: TensorParallel | None = None, pp: PipelineParallel | None = None) -> Transformer:
    """The model with its parameters on the meta device: shapes only, no memory; this rank's slice of it under
    tensor parallelism, its stages' part under pipeline parallelism."""
    with torch.device("meta"):
        return Transformer(spec, tp, pp)


def materialize(model: Transformer, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
                keep=None) -> Transformer:
    """Allocates a meta model's parameters on `device` in `dtype` and initializes them from `seed`. With `keep`,
    parameter by parameter: `keep(name, p)` returns where each initialized parameter lives from then on (host
    memory for offloaded ones), so that a model larger than the GPU never sits on it whole. Under tensor or pipeline
    parallelism every parameter of the whole model is initialized whole, in order, as one process would, and this
    rank keeps its slice of those it holds."""
    model.to(dtype)  # still on meta: costs nothing, and memory is allocated once, in the final dtype
    model.materialized_dtype = dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    if keep is None and not model.tp.active and not model.pp.active:
        model.to_empty(device=device)
        model.init_weights(generator)
        return model
    model.to_empty(device="cpu")  # dense, so that `.data` may take tensors of any device; no page is touched
    mine = dict(model.named_parameters())
    for name, p in build_model(model.spec).named_parameters():  # the whole model's, in its order
        whole = torch.empty(p.shape, dtype=dtype, device=device)
        model.init_parameter(name, whole, generator)
        if name in mine:
            mine[name].data = model.tp.split(name, whole)
            if keep is not None:
                mine[name].data = keep(name, mine[name])
    return model
