"""Where each parameter group's weights, gradients and block inputs are during a step, behind one interface: the
training loop, the optimizer, the meter and checkpoints talk to `Placement` alone.

A group's weights either stay where they were initialized (resident), or come to the device only to compute, from a
`WeightSource`: the host offload (memory/offload.py) for a streamed block, the sharding engine (parallel/shard.py)
for a sharded one (whose shard may itself be streamed). Both implement the same three calls, and `Placement`
schedules them alike, one block ahead:
- forward: block i's weights are fetched while block i-1 computes (the first block's during the embedding's
  lookup, the head's while the last block runs);
- backward: block i's weights, input (offload_residuals) and gradient sums so far (offload_gradients) come back while
  block i+1's backward runs (the last block's while the head's runs), and go again once its gradients are made.
It hooks the model the way FSDP2's `fully_shard` does, without replacing any of its methods: forward hooks around each
block and before the embedding and the final norm, and a post-accumulate-grad hook on each parameter.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn

from fastml.plan import Plan, block_group, layer_of
from fastml.executor.memory.offload import HostOffload
from fastml.executor.model.transformer import layer_groups
from fastml.executor.memory.streams import Copier


class WeightSource(Protocol):
    """Where the weights of the groups that come to the device only to compute live between uses."""

    def keep(self, group: str, name: str, p: torch.Tensor) -> torch.Tensor:
        """Where an initialized parameter lives from then on; what the parameter points at between uses."""

    def fetch(self, group: str, backward: bool = False) -> tuple[list[torch.Tensor], object]:
        """Starts bringing the group's weights whole onto the device: (its parameters' tensors, work whose `wait()`
        makes the compute stream wait for them)."""

    def homes(self, group: str) -> list[torch.Tensor]:
        """What the group's parameters point at again once it has computed."""


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


class Placement:
    """The model's groups placed as the plan says (the module's docstring). `parallel`: the sharding engine of a job
    of several ranks, or None. Built on the meta model: `keep` places freshly initialized parameters (materialize
    replaces the meta ones), then `install` hooks the materialized model."""

    def __init__(self, plan: Plan, shapes: dict[str, dict[str, torch.Size]], device: torch.device, copier: Copier,
                 dtype: torch.dtype, parallel=None):
        self.device, self.copier, self.shapes, self.parallel = device, copier, shapes, parallel
        self.sharded = parallel.sharded if parallel is not None else frozenset()
        self.offload = HostOffload(plan, shapes, device, copier, dtype, self.sharded,
                                   grads_summed_elsewhere=parallel is not None and parallel.every_micro_batch,
                                   world=parallel.world if parallel is not None else None,
                                   timeout_s=getattr(getattr(parallel, "comm", None), "watchdog", None) and
                                   parallel.comm.watchdog.timeout_s)
        self.streamed = self.offload.streamed
        self.fetched = self.streamed | self.sharded  # groups whose weights come to the device only to compute
        self._fetched: dict[str, tuple[list[torch.Tensor], object]] = {}  # group -> device tensors, work
        self._saved_by_reference = None  # the running block's saved-tensor hooks
        self._accumulated: dict[str, int] = {}  # group -> parameters whose gradient this backward has accumulated
        self._awaiting_gradients: dict[str, int] = {}  # the head's groups: forward passes whose backward is to come
        self.micro_batch, self.last_micro_batch = 0, True
        self.overlapped = plan.knobs.overlap_cpu_step
        self.wait_for_step = lambda group: None
        """knobs.overlap_cpu_step: waits for a group's optimizer step still running on the CPU (set by the
        optimizer, optim.AdamW.wait_group); called before a forward pass first reads the group's weights."""
        self.finish_steps = lambda: None
        """Waits for every group's step (optim.AdamW.finish_steps): for what reads all weights at once (the cast of
        cached fp8 weights, evaluation, samples)."""

    def _source(self, group: str) -> WeightSource:
        return self.parallel if group in self.sharded else self.offload

    # --- placement ----------------------------------------------------------------------------------------------

    @property
    def places_parameters(self) -> bool:
        """Whether `keep` places parameters anywhere but where they were initialized."""
        return bool(self.streamed) or self.parallel is not None

    def keep(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """Where a parameter lives once initialized: with its weight source, or (several ranks) in its group's flat
        vector, or where it is."""
        group = layer_of(name)
        if group in self.fetched:
            return self._source(group).keep(group, name, p)
        return self.parallel.keep(group, name, p) if self.parallel is not None else p.data

    def settle(self) -> None:
        """Where the node's ranks share the streamed weights' host copy (knobs.share_host_weights), each having written
        its shard of it (placed, loaded, or stepped): returns once all have."""
        self.offload.settle()

    def host_flat(self, group: str) -> torch.Tensor | None:
        """A streamed block's whole weights in host memory, as one vector, or None."""
        return self.offload.host_flat(group)

    def install(self, model: nn.Module) -> None:
        """Hooks the materialized model (the module's docstring)."""
        named = layer_groups(model)
        self.params = {group: [p for _, p in params] for group, params in named.items()}
        self.group_of = {p: group for group, params in self.params.items() for p in params}
        self.name_of = {p: name for params in named.values() for name, p in params}
        self.blocks = model.blocks
        hooked = set(self.params) if self.parallel is not None else self.fetched | self.offload.grads_out
        for group in hooked:
            for p in self.params[group]:
                p.register_post_accumulate_grad_hook(self._on_grad_accumulated)
        if self.fetched | self.offload.grads_out | self.offload.residuals_out:
            for index, block in model.held_blocks():
                block.register_forward_pre_hook(self._before_block(index))
                block.register_forward_hook(self._after_block(index), always_call=True)
        if self.overlapped:
            self._wait_for_steps_before_use(model)
        self.settle()  # every rank's part of the host weights placed before any rank fetches them
        if "embed" in self.sharded:  # its backward pass reads no weights: gathered for the lookup alone
            model.embed.register_forward_pre_hook(_eager(lambda module, args: self._acquire_embed()))
            model.embed.register_forward_hook(_eager(lambda module, args, out: self._release("embed")))
        if "head" in self.sharded:  # the final norm and the LM head, until their gradients are made
            tied = model.lm_head is None and "embed" in self.sharded
            model.norm.register_forward_pre_hook(_eager(lambda module, args: self._acquire_head(tied)))

    def _wait_for_steps_before_use(self, model: nn.Module) -> None:
        """knobs.overlap_cpu_step: each group's weights are read only once its step is done. A streamed block's are
        read by their fetch (`_fetch_weights`), one block ahead; the others' by the module that computes with
        them: the embedding's lookup, the block, the final norm and LM head."""
        # A later pipeline stage holds the embedding for its tied LM head alone (model/transformer.py).
        embed_user = model.embed if model.pp.first or model.embed is None else model.norm
        users = {"embed": embed_user, "head": model.norm,
                 **{block_group(i): block for i, block in model.held_blocks()}}
        for group, module in users.items():
            if group not in self.fetched and module is not None:
                module.register_forward_pre_hook(_eager(lambda module, args, group=group: self.wait_for_step(group)))

    # --- the step's phases, called by the loop and the optimizer ----------------------------------------------------

    def begin_step(self) -> None:
        self.offload.begin_step()
        if self.parallel is not None:
            self.parallel.begin_step()

    def begin_micro_batch(self, index: int, last: bool) -> None:
        """The passes that follow are micro-batch `index`'s, the step's `last` or not (under pipeline parallelism a
        step's passes run its micro-batches in the schedule's order: a block's in order all the same)."""
        self.micro_batch, self.last_micro_batch = index, last

    def end_evaluation(self) -> None:
        """After forward passes without gradients (the validation loss): the head's weights, which a training step
        keeps whole until their gradients are made, go back to their homes."""
        self._release("head")
        self._release("embed")

    def host_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The step's gradient of `p` in host memory (complete after `finish_backward`); None if it stays on the
        device."""
        return self.offload.host_grad(self.name_of[p])

    @property
    def grad_norms(self) -> dict[nn.Parameter, torch.Tensor]:
        """The norms of the gradients in host memory, taken on the device before they left."""
        return self.offload.grad_norms

    def finish_backward(self) -> None:
        """Completes the gradients' reductions over the ranks and their copies to the host, and the weights' copies
        from it, before the CPU reads the one and overwrites the other."""
        unfinished = [group for group, count in self._accumulated.items() if count]
        if unfinished:  # never reduced nor moved: with several ranks the next step's collectives would not match
            raise RuntimeError(f"{unfinished[0]}: {self._accumulated[unfinished[0]]} of its "
                               f"{len(self.params[unfinished[0]])} parameters had a gradient in this backward pass; "
                               f"every parameter must take part in the loss")
        awaiting = [group for group, count in self._awaiting_gradients.items() if count]
        if awaiting:  # kept whole, the next step would compute with these weights as they were before its update
            raise RuntimeError(f"{awaiting[0]}: {self._awaiting_gradients[awaiting[0]]} forward passes of this step "
                               f"had no backward pass")
        if self.parallel is not None:
            self.parallel.finish()
        self.offload.finish()

    def tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
        """What the placement holds beside the parameters and the optimizer state, by memory category, wherever it is
        (the meter tells device from host by their storage)."""
        held = self.offload.host_tensors()
        if self.parallel is not None:
            for part in (self.parallel.host_tensors(), self.parallel.gpu_tensors()):
                for category, tensors in part.items():
                    held[category] = held.get(category, []) + tensors
        return held

    # --- forward and backward of one block ------------------------------------------------------------------------

    def _before_block(self, index: int):
        group = block_group(index)

        @torch.compiler.disable  # a compiled block's graph holds its arithmetic, not these copies
        def hook(module, args):
            self._acquire(group)
            after = block_group(index + 1) if index + 1 < len(self.blocks) else "head"
            if after in self.params:  # not one another pipeline stage holds
                self._fetch_weights(after)
            self._saved_by_reference = self._weights_saved_by_reference(group)
            self._saved_by_reference.__enter__()  # left by the hook after the block
        return hook

    def _after_block(self, index: int):
        group = block_group(index)

        @torch.compiler.disable
        def hook(module, args, out):
            if self._saved_by_reference is not None:
                self._saved_by_reference.__exit__(None, None, None)
                self._saved_by_reference = None
            if out is None:  # the block raised (the hook is always called): nothing else to undo
                return None
            training = torch.is_grad_enabled()  # not while evaluating: no backward pass follows
            if training and group in self.sharded and group not in self.streamed:  # a streamed shard is on the host
                self.parallel.gathered(group, [p.data for p in self.params[group]])
            self._release(group)
            if not training:
                return out
            if group in self.offload.residuals_out:
                self.offload.residual_to_host(group, self.micro_batch, args[0])
            return _BeforeBackward.apply(out, lambda: self._before_backward(index))
        return hook

    def _before_backward(self, index: int) -> None:
        """Runs as backward reaches block `index`: its weights, input and gradient sums must be on the device, and the
        block below's are fetched meanwhile."""
        group = block_group(index)
        self._fetch_for_backward(group)
        self._acquire(group)
        self.offload.wait_residual(group, self.micro_batch)
        self.offload.take_grad_sums(group, self.params[group])
        if block_group(index - 1) in self.params:  # not the first block, nor (a pipeline stage's) one held elsewhere
            self._fetch_for_backward(block_group(index - 1))

    def _fetch_for_backward(self, group: str) -> None:
        self._fetch_weights(group, backward=True)
        self.offload.fetch_residual(group, self.micro_batch)
        if group in self.offload.grads_out and self.micro_batch > 0:  # later micro-batches add into the sum so far
            self.offload.fetch_grad_sums(group)

    def _fetch_weights(self, group: str, backward: bool = False) -> None:
        if group in self.fetched and group not in self._fetched:
            self.wait_for_step(group)  # its source's copy is what the optimizer's step writes
            self._fetched[group] = self._source(group).fetch(group, backward)

    def _weights_saved_by_reference(self, group: str):
        """While a fetched block runs forward, autograd saves its weights (or views of them, such as a transpose) by a
        reference to the parameter, not to the device copy, which would stay alive until backward: backward rebuilds
        each from the copy fetched for it then."""
        if group not in self.fetched:
            return contextlib.nullcontext()
        # A gathered block's parameters are views of one buffer: any of them stands for it (the offsets are the
        # storage's).
        owners = {p.untyped_storage().data_ptr(): p for p in self.params[group]}

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
        self._fetch_weights(block_group(0))

    def _acquire_head(self, tied: bool) -> None:
        """The final norm is about to run: the head's weights (and the embedding's, the head's when tied) must be
        whole; they stay so until their gradients are made, for every micro-batch whose forward pass has run (a
        pipeline's last stage may run several before their backward passes, whose final norm reads its weight).
        The last block's are fetched for its backward pass meanwhile."""
        held = ["head", "embed"] if tied else ["head"]
        for group in held:
            self._acquire(group)
        if torch.is_grad_enabled():
            for group in self.fetched.intersection(held):
                self._awaiting_gradients[group] = self._awaiting_gradients.get(group, 0) + 1
            self._fetch_for_backward(block_group(len(self.blocks) - 1))

    def _acquire(self, group: str) -> None:
        if group not in self.fetched:
            return
        self._fetch_weights(group)
        tensors, ready = self._fetched[group]
        ready.wait()
        for p, tensor in zip(self.params[group], tensors):
            p.data = tensor.view(p.shape)

    def _release(self, group: str) -> None:
        """Points the group's parameters back at their homes; the device copies go back to the allocator, on the
        compute stream that used them."""
        if group not in self.fetched:
            return
        self._fetched.pop(group, None)
        for p, home in zip(self.params[group], self._source(group).homes(group)):
            p.data = home.view(p.shape)

    # --- gradients ----------------------------------------------------------------------------------------------

    def _on_grad_accumulated(self, p: nn.Parameter) -> None:
        group = self.group_of[p]
        self._accumulated[group] = self._accumulated.get(group, 0) + 1
        if self._accumulated[group] < len(self.params[group]):
            return
        self._accumulated[group] = 0
        offloaded = group in self.offload.grads_out
        if self.parallel is not None:
            self.parallel.grads_ready(group, self.params[group], self.last_micro_batch, wait=offloaded)
        if offloaded and self.params[group][0].grad is not None:  # not scattered over the ranks
            self.offload.grads_to_host(group, self.params[group], self.last_micro_batch)
        if self._awaiting_gradients.get(group):
            self._awaiting_gradients[group] -= 1
            if self._awaiting_gradients[group]:  # another micro-batch's backward pass still reads them
                return
        self._release(group)


def _eager(hook):
    """A hook that runs eagerly, outside any compiled graph."""
    return torch.compiler.disable(hook)
