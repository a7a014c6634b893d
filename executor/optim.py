"""AdamW with fp32 master weights for low-precision parameters, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from fastml.plan import Training

# Bounds the temporary fp32 gradients (to be replaced by one parameter group at a time).
OPTIMIZER_CHUNK_NUMEL = 2**28


class MasterWeightAdamW:
    """torch's AdamW (fused on GPU) stepping fp32 copies of bf16 parameters, which then receive the rounded result.

    Parameters already in fp32 (CPU training) are stepped in place with no copy. Weight decay applies to matrices
    only, not to norms and biases.
    """

    def __init__(self, model: nn.Module, training: Training):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.use_masters = any(p.dtype != torch.float32 for p in self.params)
        if self.use_masters:
            self.masters = [p.detach().to(torch.float32, copy=True).requires_grad_() for p in self.params]
        else:
            self.masters = self.params
        decay = [m for m in self.masters if m.ndim >= 2]
        no_decay = [m for m in self.masters if m.ndim < 2]
        on_gpu = self.params[0].is_cuda
        self.inner = torch.optim.AdamW(
            [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=training.lr, betas=(training.beta1, training.beta2), fused=on_gpu, foreach=not on_gpu)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        if not self.use_masters:
            self.inner.step()
            return
        for chunk in self._chunks():
            for p, master in chunk:
                master.grad = p.grad.float()
            self.inner.step()  # steps exactly the masters that have a gradient: this chunk
            for p, master in chunk:
                p.copy_(master)
                master.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a resumed run needs, by parameter name: fp32 master weights and Adam's m, v and step."""
        tensors = {}
        for name, master in zip(self.names, self.masters):
            if self.use_masters:
                tensors[f"master/{name}"] = master.detach()
            for key, value in self.inner.state.get(master, {}).items():
                tensors[f"{key}/{name}"] = value
        return tensors

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, master in zip(self.names, self.masters):
            if self.use_masters:
                master.copy_(tensors[f"master/{name}"])
            state = {key: tensors[f"{key}/{name}"].to(master.device) for key in ("step", "exp_avg", "exp_avg_sq")
                     if f"{key}/{name}" in tensors}
            if state:  # fused AdamW keeps `step` on the GPU, foreach on the CPU: both beside the master here
                self.inner.state[master] = state

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _chunks(self):
        chunk, numel = [], 0
        for p, master in zip(self.params, self.masters):
            if p.grad is None:
                continue
            chunk.append((p, master))
            numel += p.numel()
            if numel >= OPTIMIZER_CHUNK_NUMEL:  # bounds the temporary fp32 gradients
                yield chunk
                chunk, numel = [], 0
        if chunk:
            yield chunk


def lr_at(step: int, training: Training) -> float:
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step (steps - 1)."""
    if step < training.warmup_steps:
        return training.lr * (step + 1) / training.warmup_steps
    decay_steps = max(1, training.steps - 1 - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / decay_steps)
    floor = training.lr * training.min_lr_ratio
    return floor + (training.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
