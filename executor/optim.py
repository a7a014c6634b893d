"""AdamW over one parameter group per layer, with fp32 master weights for low-precision parameters, and the
learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adamw import adamw

from fastml.config import fail
from fastml.plan import Training

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EPS = 1e-8  # torch.optim.AdamW's default


class AdamW(torch.optim.Optimizer):
    """torch's AdamW arithmetic (fused on a GPU, foreach on a CPU) over one parameter group per layer: the
    embedding, each block, then the final norm with the LM head (`layer_groups`). A group is what a later version
    places on the GPU or in host memory, shards, and saves per rank.

    Parameters that are not in `master_dtype` get master copies in the optimizer state ("master"): the step updates
    them and rounds the result into the parameters, making gradients in the master dtype for one group at a time.
    Adam's m and v are in `state_dtype`. Matrices decay, norms and biases do not (the group's "decay" flags).
    `lr` is each group's "lr", set by the training loop (`set_lr`) before each step.
    """

    def __init__(self, model: nn.Module, training: Training, master_dtype: str = "fp32", state_dtype: str = "fp32"):
        groups = [{"params": named, "layer": layer, "decay": [p.ndim >= 2 for _, p in named]}
                  for layer, named in layer_groups(model).items()]
        super().__init__(groups, {"lr": training.lr, "betas": (training.beta1, training.beta2), "eps": EPS,
                                  "weight_decay": training.weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = self._initial_state(p, DTYPES[master_dtype], DTYPES[state_dtype])

    @staticmethod
    def _initial_state(p: torch.Tensor, master_dtype: torch.dtype, state_dtype: torch.dtype) -> dict:
        if master_dtype != torch.float32:
            fail("knobs.master_dtype", "bf16 master weights need stochastic rounding, which this executor does not "
                                       "do yet; use 'fp32'")
        master = p.detach().to(master_dtype, copy=True) if p.dtype != master_dtype else p
        # Fused AdamW reads its step count on the device; foreach AdamW reads it on the host.
        step_device = p.device if p.is_cuda else "cpu"
        state = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                 "exp_avg": torch.zeros_like(master, dtype=state_dtype),
                 "exp_avg_sq": torch.zeros_like(master, dtype=state_dtype)}
        if master is not p:
            state["master"] = master
        return state

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("this AdamW takes no closure: the training loop computes the loss before the step")
        for group in self.param_groups:
            for decays in (True, False):
                params = [p for p, d in zip(group["params"], group["decay"]) if d == decays and p.grad is not None]
                if params:
                    self._step(group, params, group["weight_decay"] if decays else 0.0)

    def _step(self, group: dict, params: list[torch.Tensor], weight_decay: float) -> None:
        states = [self.state[p] for p in params]
        masters = [s.get("master", p) for s, p in zip(states, params)]
        grads = [p.grad.to(m.dtype) for p, m in zip(params, masters)]  # a copy only where the dtypes differ
        fused = params[0].is_cuda
        beta1, beta2 = group["betas"]
        adamw(
            masters, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
            [s["step"] for s in states], foreach=not fused, fused=fused, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=weight_decay, eps=group["eps"], maximize=False)
        rounded = [(p, m) for p, m in zip(params, masters) if m is not p]
        if rounded:
            torch._foreach_copy_(*map(list, zip(*rounded)))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a resumed run needs, by parameter name: master weights (where the parameters are not their own)
        and Adam's m, v and step."""
        tensors = {}
        for name, state in self._named_states():
            for key, value in state.items():
                tensors[f"{key}/{name}"] = value
        return tensors

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, state in self._named_states():
            for key, value in state.items():
                if f"{key}/{name}" in tensors:  # a checkpoint written before any step has no Adam state
                    value.copy_(tensors[f"{key}/{name}"])

    def _named_states(self):
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                yield name, self.state[p]


def layer_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The trainable parameters by name, grouped by layer in model order: `embed`, `blocks.0`, `blocks.1`, ...,
    and `head` for everything else (the final norm and an untied LM head)."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            parts = name.split(".")
            layer = ".".join(parts[:2]) if parts[0] == "blocks" else "embed" if parts[0] == "embed" else "head"
            groups.setdefault(layer, []).append((name, p))
    return groups


def lr_at(step: int, training: Training) -> float:
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step (steps - 1)."""
    if step < training.warmup_steps:
        return training.lr * (step + 1) / training.warmup_steps
    decay_steps = max(1, training.steps - 1 - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / decay_steps)
    floor = training.lr * training.min_lr_ratio
    return floor + (training.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
