"""PLACEHOLDER until the cpuadam branch lands: the reference arithmetic only."""
import torch


@torch.no_grad()
def adamw_step_(master, exp_avg, exp_avg_sq, grad, weight_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    g = grad.float() * grad_scale
    if grad.dtype == torch.bfloat16 and grad_scale != 1.0:
        g = g.to(torch.bfloat16).float()
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / bc2 ** 0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if weight_out is not None:
        weight_out.copy_(master)
