"""The plan's offload knobs for weights, gradients and residuals on a GPU: what lives in pinned host memory, and
the copies that bring it to the GPU just before it is needed and send it back as soon as it is made; and, with
several ranks, when a sharded group's weights are gathered and its gradients reduced (shard.py does both).

Per block (a parameter group of optim.layer_groups), as `fastml.plan.offloaded_groups` names them:
- offload_weights: the block's bf16 weights live in pinned host memory; a parameter points at its host copy except
  while the block runs, when it points at a GPU copy fetched on the host-to-device stream one block ahead (forward
  and backward, every micro-batch).
- offload_gradients: once backward has accumulated a block's gradients they go to pinned host memory on the
  device-to-host stream and leave the GPU. Micro-batches after the first fetch the sum so far back one block ahead,
  so that backward adds into it as it would without offload (the same arithmetic, bit for bit).
- offload_residuals: a block's input (the residual stream, all that block recompute keeps) goes to the host after
  the block's forward, its GPU storage freed, and comes back one block ahead of the block's backward.
Master weights and Adam states are the optimizer's (optim.py). On a CPU plan the "GPU" is the CPU: the same code
runs with plain copies, which is how CI tests it.

Ordering: every copy waits for the compute stream's work so far, and compute waits for a copy's event before the
block that needs it. A GPU buffer is allocated on the compute stream; one read by a copy stream after compute has
let it go is marked with `record_stream`, so that the allocator does not hand it out before the copy is done.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fastml.plan import Plan, offloaded_groups
from fastml.executor.memory.optim import layer_groups, layer_of
from fastml.executor.memory.pinned import pinned_empty
from fastml.executor.parallel.shard import CopyDone


class Copier:
    """The host-to-device and device-to-host copy streams of a GPU; plain synchronous copies on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def copy(self, stream, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=None):
        """Copies each (destination, source) on `stream` once the compute stream's work so far and the event `after`
        are done; returns the event marking the copies' end (None on a CPU, where they are done already)."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        stream.wait_stream(torch.cuda.current_stream())
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return stream.record_event()

    def wait(self, event) -> None:
        """The compute stream waits for a copy."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class _BeforeBackward(torch.autograd.Function):
    """Identity in forward; its backward runs `callback` just before the backward of what produced its input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, callback) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.callback()
        return grad, None


class _Flat:
    """One pinned host buffer holding several blocks' tensors back to back, with a view per parameter name."""

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype, cuda: bool):
        self.buffer = pinned_empty(sum(shape.numel() for shape in shapes.values()), dtype, cuda)
        self.views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in shapes.items():
            self.views[name] = self.buffer[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()


class HostOffload:
    """Weights, gradients and block inputs in host memory, as the plan's offload knobs say (see the module's
    docstring). Built on the meta model: `keep` places freshly initialized parameters (materialize replaces the
    meta ones), then `install` hooks the model."""

    def __init__(self, model: nn.Module, plan: Plan, device: torch.device, parallel=None):
        knobs, num_layers = plan.knobs, plan.model.num_layers
        self.device = device
        self.copier = Copier(device)
        self.shapes = {layer: {name: p.shape for name, p in named} for layer, named in layer_groups(model).items()}
        self.parallel = parallel
        if parallel is not None:
            parallel.copier = self.copier
        self.sharded = parallel.sharded if parallel is not None else frozenset()
        self.streamed = offloaded_groups(knobs, "offload_weights", num_layers)
        self.fetched = self.streamed | self.sharded  # blocks whose weights come to the GPU only to compute
        # Sharded gradients sum the micro-batches in their host shard (shard.py); unsharded, the whole sum is here.
        self.grads_out = frozenset() if parallel is not None and parallel.every_micro_batch else \
            offloaded_groups(knobs, "offload_gradients", num_layers)
        self.residuals_out = offloaded_groups(knobs, "offload_residuals", num_layers)
        self.weights: _Flat | None = None
        self.grads: _Flat | None = None
        self.residuals: dict[str, torch.Tensor] = {}
        self._fetched: dict[str, tuple[list[torch.Tensor], object]] = {}  # group -> GPU tensors, copy event
        self._residual_events: dict[str, object] = {}  # group -> event of its input's copy to the host
        self._saved_inputs: dict[str, torch.Tensor] = {}  # group -> the block input whose storage went to host
        self._grad_events: dict[str, object] = {}  # group -> event of its gradients' copy to the host
        self._grad_sums: dict[str, tuple[list[torch.Tensor], object]] = {}  # group -> sums so far on the GPU, event
        self._accumulated: dict[str, int] = {}  # group -> parameters whose gradient this backward has accumulated
        self.grad_norms: dict[nn.Parameter, torch.Tensor] = {}  # offloaded gradients' norms, taken on the GPU
        self.micro_batch, self.last_micro_batch = 0, True

    # --- placement -------------------------------------------------------------------------------------------

    @property
    def places_parameters(self) -> bool:
        """Whether `keep` places parameters anywhere but where they were initialized."""
        return bool(self.streamed) or self.parallel is not None

    def keep(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """Where a parameter lives once initialized: its host copy for a streamed block; with several ranks, its
        group's flat vector or this rank's shard (shard.py, in host memory for a streamed block); else where it is."""
        group = layer_of(name)
        if group in self.sharded:
            return self.parallel.keep(group, name, p, host=group in self.streamed)
        if group not in self.streamed:
            return self.parallel.keep(group, name, p, host=False) if self.parallel is not None else p.data
        if self.weights is None:
            self.weights = _Flat(self._shapes(self.streamed - self.sharded), p.dtype, self.copier.cuda)
        host = self.weights.views[name]
        host.copy_(p.data)
        return host

    def host_flat(self, group: str) -> torch.Tensor | None:
        """A streamed block's weights in host memory, as one vector (they lie back to back), or None."""
        if group not in self.streamed or group in self.sharded:
            return None
        views = [self.weights.views[name] for name in self.shapes[group]]
        start = views[0].storage_offset() - self.weights.buffer.storage_offset()
        return self.weights.buffer[start:start + sum(v.numel() for v in views)]

    def _shapes(self, layers: frozenset[str]) -> dict[str, torch.Size]:
        return {name: shape for layer, shapes in self.shapes.items() if layer in layers for name, shape in shapes.items()}

    def install(self, model: nn.Module, param_dtype: torch.dtype) -> None:
        """Hooks the materialized model: its blocks run through `run_block`, and backward reports each parameter's
        gradient."""
        named = layer_groups(model)
        self.params = {layer: [p for _, p in params] for layer, params in named.items()}
        self.group_of = {p: layer for layer, params in self.params.items() for p in params}
        self.name_of = {p: name for params in named.values() for name, p in params}
        if self.grads_out:
            self.grads = _Flat(self._shapes(self.grads_out), param_dtype, self.copier.cuda)
        hooked = set(self.params) if self.parallel is not None else self.fetched | self.grads_out
        for name in hooked:
            for p in self.params[name]:
                p.register_post_accumulate_grad_hook(self._on_grad_accumulated)
        if self.active:
            self.blocks = model.blocks
            model.run_block = self.run_block  # an instance attribute: Transformer.forward calls it for each block
        if "embed" in self.sharded:  # its backward pass reads no weights: gathered for the lookup alone
            model.embed.register_forward_pre_hook(lambda module, args: self._acquire_embed())
            model.embed.register_forward_hook(lambda module, args, out: self._release("embed"))
        if "head" in self.sharded:  # the final norm and the LM head, until their gradients are made
            tied = model.lm_head is None and "embed" in self.sharded
            model.norm.register_forward_pre_hook(lambda module, args: self._acquire_head(tied))

    @property
    def active(self) -> bool:
        return bool(self.fetched or self.grads_out or self.residuals_out)

    # --- the step's phases, called by step.py ------------------------------------------------------------------

    def begin_micro_batch(self, index: int, last: bool) -> None:
        self.micro_batch, self.last_micro_batch = index, last
        if index == 0:
            self.grad_norms.clear()

    def host_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The step's gradient of `p` in host memory (complete after `finish_backward`); None if it stays on the
        GPU."""
        return self.grads.views.get(self.name_of[p]) if self.grads is not None else None

    def finish_backward(self) -> None:
        """Completes the gradients' reductions over the ranks, waits for the last gradients to reach the host, and
        for the last weights to leave it, before the CPU reads the one and overwrites the other."""
        if self.parallel is not None:
            self.parallel.finish()
        for event in self._grad_events.values():
            if event is not None:
                event.synchronize()
        self._grad_events.clear()
        if self.copier.cuda and self.streamed:
            self.copier.h2d.synchronize()

    # --- forward and backward of one block ---------------------------------------------------------------------

    def run_block(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        name = f"blocks.{index}"
        self._acquire(name)
        self._fetch_weights(f"blocks.{index + 1}" if index + 1 < len(self.blocks) else "head")
        with self._weights_saved_by_reference(name):
            out = self.blocks[index](x, cos, sin)
        if name in self.sharded and name not in self.streamed:  # a streamed shard is in host memory already
            self.parallel.gathered(name, [p.data for p in self.params[name]])
        self._release(name)
        if name in self.residuals_out:
            self._residual_to_host(name, x)
        return _BeforeBackward.apply(out, lambda: self._before_backward(index))

    def _before_backward(self, index: int) -> None:
        """Runs as backward reaches block `index`: its weights, input and gradient sums must be on the GPU, and the
        block below's are fetched meanwhile."""
        name = f"blocks.{index}"
        self._fetch_for_backward(name)
        self._acquire(name)
        self.copier.wait(self._residual_events.pop(name, None))
        if name in self._grad_sums:  # assigned only now: a gradient must be on its parameter's device
            sums, event = self._grad_sums.pop(name)
            self.copier.wait(event)
            for p, g in zip(self.params[name], sums):
                p.grad = g
        if index > 0:
            self._fetch_for_backward(f"blocks.{index - 1}")

    def _fetch_for_backward(self, name: str) -> None:
        self._fetch_weights(name, backward=True)
        self._fetch_residual(name)
        self._fetch_grad_sums(name)

    # weights

    def _fetch_weights(self, name: str, backward: bool = False) -> None:
        """Starts bringing a block's weights to the GPU: gathered from the ranks' shards, or copied from the host."""
        if name not in self.fetched or name in self._fetched:
            return
        if name in self.sharded:
            self._fetched[name] = self.parallel.gather(name, backward)
            return
        host = [self.weights.views[self.name_of[p]] for p in self.params[name]]
        gpu = [torch.empty_like(h, device=self.device) for h in host]
        self._fetched[name] = gpu, CopyDone(self.copier, self.copier.copy(self.copier.h2d, list(zip(gpu, host))))

    def _weights_saved_by_reference(self, name: str):
        """While a streamed block runs forward, autograd saves its weights (or views of them, such as a transpose)
        by a reference to the parameter, not to the GPU copy, which would stay alive until backward: backward
        rebuilds each from the copy fetched for it then."""
        if name not in self.fetched:
            return contextlib.nullcontext()
        # A gathered block's parameters are views of one buffer: any of them stands for it (the offsets are the
        # storage's).
        owners = {p.untyped_storage().data_ptr(): p for p in self.params[name]}

        def pack(t: torch.Tensor):
            owner = owners.get(t.untyped_storage().data_ptr())
            return t if owner is None else (owner, t.shape, t.stride(), t.storage_offset())

        def unpack(saved):
            if isinstance(saved, torch.Tensor):
                return saved
            owner, shape, stride, offset = saved
            return owner.data.as_strided(shape, stride, offset)
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _acquire_embed(self) -> None:
        """The embedding's lookup is about to run: its weights must be whole, and the first block's are fetched
        meanwhile."""
        self._acquire("embed")
        self._fetch_weights("blocks.0")

    def _acquire_head(self, tied: bool) -> None:
        """The final norm is about to run: the head's weights (and the embedding's, the head's when tied) must be
        whole; they stay so until their gradients are made. The last block's are fetched for its backward pass
        meanwhile."""
        self._acquire("head")
        if tied:
            self._acquire("embed")
        self._fetch_for_backward(f"blocks.{len(self.blocks) - 1}")

    def _acquire(self, name: str) -> None:
        if name not in self.fetched:
            return
        self._fetch_weights(name)
        gpu, ready = self._fetched[name]
        ready.wait()
        for p, tensor in zip(self.params[name], gpu):
            p.data = tensor.view(p.shape)

    def _release(self, name: str) -> None:
        """Points the block's parameters back at their host copies (or, sharded, at placeholders without storage);
        the GPU copies go back to the allocator, on the compute stream that used them."""
        if name not in self.fetched:
            return
        self._fetched.pop(name, None)
        homes = self.parallel.placeholder_views(name) if name in self.sharded else \
            [self.weights.views[self.name_of[p]] for p in self.params[name]]
        for p, home in zip(self.params[name], homes):
            p.data = home.view(p.shape)

    # residuals

    def _residual_to_host(self, name: str, x: torch.Tensor) -> None:
        storage = x.untyped_storage()
        if not x.is_contiguous() or storage.nbytes() != x.nbytes:
            raise RuntimeError(f"{name}: its input does not own its storage; offload_residuals cannot move it")
        host = self.residuals.get(name)
        if host is None or host.shape != x.shape:
            host = self.residuals[name] = pinned_empty(x.numel(), x.dtype, self.copier.cuda).view(x.shape)
        self._residual_events[name] = self.copier.copy(self.copier.d2h, [(host, x.detach())])
        if self.copier.cuda:
            x.record_stream(self.copier.d2h)
        storage.resize_(0)  # every view of it (autograd's saved ones included) comes back in _fetch_residual
        self._saved_inputs[name] = x

    def _fetch_residual(self, name: str) -> None:
        x = self._saved_inputs.pop(name, None)
        if x is None:
            return
        x.untyped_storage().resize_(x.nbytes)
        # Written through `.data`, which does not count as a change of x: autograd's saved views of x stay valid.
        self._residual_events[name] = self.copier.copy(self.copier.h2d, [(x.data, self.residuals[name])],
                                                       after=self._residual_events.get(name))

    # gradients

    def _fetch_grad_sums(self, name: str) -> None:
        """Micro-batches after the first add into the sum so far: it comes back from the host before the block's
        backward, which waits for it in _before_backward."""
        if name not in self.grads_out or self.micro_batch == 0 or name in self._grad_sums:
            return
        host = [self.grads.views[self.name_of[p]] for p in self.params[name]]
        gpu = [torch.empty_like(h, device=self.device) for h in host]
        self._grad_sums[name] = gpu, self.copier.copy(self.copier.h2d, list(zip(gpu, host)),
                                                      after=self._grad_events.pop(name, None))

    def _on_grad_accumulated(self, p: nn.Parameter) -> None:
        name = self.group_of[p]
        self._accumulated[name] = self._accumulated.get(name, 0) + 1
        if self._accumulated[name] < len(self.params[name]):
            return
        self._accumulated[name] = 0
        if self.parallel is not None:
            self.parallel.grads_ready(name, self.params[name], self.last_micro_batch, wait=name in self.grads_out)
        if name in self.grads_out and self.params[name][0].grad is not None:  # not scattered over the ranks
            self._grads_to_host(name)
        self._release(name)

    def _grads_to_host(self, name: str) -> None:
        params = self.params[name]
        grads = [p.grad for p in params]
        if self.last_micro_batch:  # clipping's norms, taken where the gradients are (optim.AdamW.clip_grad_norm_)
            self.grad_norms.update(zip(params, torch._foreach_norm(grads, 2)))
        self._grad_events[name] = self.copier.copy(self.copier.d2h, [(self.grads.views[self.name_of[p]], g)
                                                                     for p, g in zip(params, grads)])
        for p, g in zip(params, grads):
            if self.copier.cuda:
                g.record_stream(self.copier.d2h)
            p.grad = None

    # --- what the meter reports --------------------------------------------------------------------------------

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The pinned host buffers by memory category."""
        tensors = {"weights": [self.weights.buffer] if self.weights else [],
                   "gradients": [self.grads.buffer] if self.grads else [],
                   "activations": list(self.residuals.values())}
        if self.parallel is not None:
            for category, held in self.parallel.host_tensors().items():
                tensors[category] = tensors[category] + held
        return {k: v for k, v in tensors.items() if v}
