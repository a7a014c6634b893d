"""Tensor parallelism on plain tensors, Megatron-LM's way: each block's q/k/v and gate/up projections are split by
output (column-parallel: a GPU computes its attention heads and its slice of the FFN's width), the attention output
and down projections by input (row-parallel: their partial products are summed over the group), and the embedding and
LM head by vocabulary, with a cross-entropy that reduces across the group (`vocab_parallel_cross_entropy_`).

The model stays the plain one of model/transformer.py with smaller linears, so that recompute, offload and the
sharding engine see ordinary parameters; the collectives are autograd functions the blocks call where a slice meets
the whole. With sequence parallelism (Korthikanti et al. 2022) the norms and residual adds between those points work
on a slice of the sequence: the all-reduces become an all-gather before a column-parallel linear and a reduce-scatter
after a row-parallel one.

A parameter's slices follow `split_rules`: fused weights are cut per part, so that rank r holds [q_r | k_r | v_r] and
[gate_r | up_r] (a plain cut of the fused tensor would give one rank all of gate and the other all of up). Weights are
made whole (`join`) to be saved and cut again (`split`) when loaded: checkpoints hold whole tensors, and resume at
any tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastml.executor.parallel.collectives import _reduce_scatter
from fastml.spec import ModelSpec


@dataclass(frozen=True)
class Split:
    """How a parameter is cut across the group: along `dim`, each of its fused `parts` (sizes along `dim`) cut
    evenly."""

    dim: int
    parts: tuple[int, ...]


def split_rules(spec: ModelSpec) -> dict[str, Split]:
    """The cut of each split parameter, by the end of its name; parameters not named here (the norms) are whole on
    every rank."""
    q, kv, ffn, vocab = spec.q_size, spec.kv_size, spec.ffn_hidden_size, spec.vocab_size
    return {"embed.weight": Split(0, (vocab,)), "lm_head.weight": Split(0, (vocab,)),
            "attn.qkv.weight": Split(0, (q, kv, kv)), "attn.qkv.bias": Split(0, (q, kv, kv)),
            "attn.out.weight": Split(1, (q,)), "ffn.gate_up.weight": Split(0, (ffn, ffn)),
            "ffn.down.weight": Split(1, (ffn,))}


class TensorParallel:
    """This rank's place in its tensor-parallel group (`size` ranks, `group`), and the collectives its blocks run.
    `sequence`: sequence parallelism, the activations between the linears cut along the sequence."""

    def __init__(self, spec: ModelSpec, size: int = 1, rank: int = 0, group=None, sequence: bool = False):
        self.size, self.rank, self.group, self.sequence = size, rank, group, sequence
        self.rules = split_rules(spec)
        self.vocab_slice = spec.vocab_size // size

    @property
    def active(self) -> bool:
        return self.size > 1

    def rule(self, name: str) -> Split | None:
        return next((rule for end, rule in self.rules.items() if name.endswith(end)), None) if self.active else None

    def replicated(self, name: str) -> bool:
        """Whether every rank of the group holds the whole parameter (and, once its gradient is summed, the same
        gradient)."""
        return self.rule(name) is None

    # --- slices of the weights ----------------------------------------------------------------------------------

    def split(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of parameter `name`'s whole tensor (a copy; the whole tensor itself where not split)."""
        rule = self.rule(name)
        if rule is None:
            return whole
        pieces = [part.tensor_split(self.size, rule.dim)[self.rank] for part in whole.split(rule.parts, rule.dim)]
        return torch.cat(pieces, rule.dim)

    def whole_shape(self, name: str, shape: torch.Size) -> torch.Size:
        """The shape of parameter `name` whose slice has `shape`."""
        rule = self.rule(name)
        if rule is None:
            return shape
        return torch.Size(d * self.size if i == rule.dim else d for i, d in enumerate(shape))

    def join(self, name: str, mine: torch.Tensor) -> torch.Tensor:
        """The whole parameter from every rank's slice (a collective over the group: each of its ranks calls it)."""
        rule = self.rule(name)
        if rule is None:
            return mine
        slices = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(slices, mine.contiguous(), group=self.group)
        return self.join_slices(name, slices)

    def join_slices(self, name: str, slices: list[torch.Tensor]) -> torch.Tensor:
        """The whole parameter from its slices, in rank order (`split`'s inverse)."""
        rule = self.rule(name)
        if rule is None:
            return slices[0]
        per_rank = [s.split([p // self.size for p in rule.parts], rule.dim) for s in slices]
        return torch.cat([torch.cat([pieces[i] for pieces in per_rank], rule.dim) for i in range(len(rule.parts))],
                         rule.dim)

    # --- collectives of the forward pass ------------------------------------------------------------------------

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input (B, T, h) of a column-parallel linear, whole on every rank: gathered along the sequence (sequence
        parallel), or as it is with its gradient summed over the group in the backward pass."""
        if not self.active:
            return x
        return _GatherSequence.apply(x, self) if self.sequence else _SumGradient.apply(x, self.group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel linear's partial output summed over the group: whole on every rank, or (sequence parallel)
        each rank's slice of the sequence."""
        if not self.active:
            return x
        return _ScatterSequence.apply(x, self) if self.sequence else _Sum.apply(x, self.group)

    def shared_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A whole weight whose gradient each rank makes only in part (the norms under sequence parallelism, the q/k
        norms of its heads): the parts summed in the backward pass."""
        return _SumGradient.apply(weight, self.group) if self.active else weight

    def embed(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The embedding of `tokens` (B, T) from this rank's rows of the vocabulary, summed over the group (`leave`):
        a token another rank holds looks up zeros here."""
        first = self.rank * self.vocab_slice
        local = tokens - first
        mine = (local >= 0) & (local < self.vocab_slice)
        rows = torch.nn.functional.embedding(local.clamp(0, self.vocab_slice - 1), weight)
        return self.leave(rows * mine.unsqueeze(-1).to(rows.dtype))

    def all_reduce_(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.active:
            dist.all_reduce(x, op=op, group=self.group)
        return x


def vocab_parallel_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel,
                                  loss_dtype: torch.dtype) -> torch.Tensor:
    """fused.cross_entropy_ over logits cut by vocabulary: each rank holds (rows, vocab / size) of them. Returns each
    row's loss logsumexp - logit[target] (the same on every rank) and turns this rank's logits into their gradient
    softmax - one_hot(target), in place. The row maxima, then the exponentials' sums and target logits, are reduced
    over the group."""
    x = logits.to(loss_dtype)
    local = targets - tp.rank * tp.vocab_slice
    mine = ((local >= 0) & (local < tp.vocab_slice))[:, None]
    index = local.clamp(0, tp.vocab_slice - 1)[:, None]
    peak = tp.all_reduce_(x.amax(1, keepdim=True), dist.ReduceOp.MAX)
    picked = x.gather(1, index) * mine
    x.sub_(peak).exp_()
    sums = tp.all_reduce_(torch.cat([x.sum(1, keepdim=True), picked], 1))
    total, picked = sums[:, :1], sums[:, 1:]
    losses = (peak + total.log() - picked).squeeze(1)
    x.div_(total).scatter_add_(1, index, -mine.to(x.dtype))
    if x is not logits:
        logits.copy_(x)
    return losses


class _Sum(torch.autograd.Function):
    """All-reduce forward; the gradient passes as it is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradient(torch.autograd.Function):
    """Identity forward; the gradient is all-reduced."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    slices = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(slices, x.contiguous(), group=tp.group)
    return torch.cat(slices, 1)


def _scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Rank r's slice of the sequence (dim 1) of the sum of every rank's `x`."""
    by_position = x.transpose(0, 1).contiguous()  # (T, B, h): the slices contiguous
    out = by_position.new_empty((by_position.shape[0] // tp.size, *by_position.shape[1:]))
    _reduce_scatter(out, by_position, group=tp.group)
    return out.transpose(0, 1)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_sequence(grad, ctx.tp), None


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _scatter_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.tp), None
