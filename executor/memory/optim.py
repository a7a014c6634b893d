"""AdamW over one parameter group per layer, with fp32 master weights for low-precision parameters, and the
learning-rate schedule."""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.optim.adamw import adamw

from fastml.plan import (CPU_STEP_CHUNK, STAGING_SLOTS, Knobs, Training, master_streamed_groups, offloaded_groups,
                         overlapped_groups)
from fastml.executor.memory import cpu_adam
from fastml.executor import native
from fastml.executor.parallel.collectives import agree
from fastml.executor.memory.pinned import pinned_empty
from fastml.executor.parallel.shard import Layout, Piece
from fastml.executor.model.transformer import layer_groups
from fastml.executor.parallel.world import World

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EPS = 1e-8  # torch.optim.AdamW's default


class AdamW(torch.optim.Optimizer):
    """torch's AdamW arithmetic (fused on a GPU, foreach on a CPU) over one parameter group per layer: the
    embedding, each block, then the final norm with the LM head (`layer_groups`), each placed as the plan's offload
    knobs say (`fastml.plan.offloaded_groups`).

    Parameters that are not in `master_dtype` get master copies in the optimizer state ("master"): the step updates
    them and rounds the result into the parameters, making gradients in the master dtype for one group at a time.
    Adam's m and v are in `optimizer_dtype`. Where masters (the parameters themselves) or m and v are bf16, the step
    is fastml's op (cpu_adam.py, on the CPU or the GPU), which writes them with stochastic rounding, its random bits
    drawn from the run's seed, the parameter, the step and the element (`rounding_seed`): a resumed run rounds as the
    uninterrupted one. With master_dtype "bf16_kahan" the bf16 parameters keep a bf16 compensation beside m and v
    ("master_low": what rounding the master to the parameter dropped), and are rounded to nearest instead. Matrices
    decay, norms and biases do not (the group's "decay" flags). `lr` is each group's "lr", set by the training loop
    (`set_lr`) before each step.

    Offload: a group in offload_optimizer keeps m and v in host memory and steps on the CPU (the C++ AdamW of
    csrc/, cpu_adam.py), writing its bf16 weights straight into their host copy where the weights are streamed, or
    none where that host copy is the master itself (knobs.stream_masters: the fetch rounds it, offload.py); a
    group in offload_master keeps its fp32 masters in host memory, and where it steps on the GPU they cross PCIe
    both ways. Gradients kept in host memory (`placement.host_grad`) are read there.

    Sharded (shard_optimizer over several ranks, shard.py): a rank keeps state for, and steps, only its shard of
    each group's flat vector, a part of a parameter (a `Piece`) where the shard boundary cuts one; it reads its
    shard of the summed gradients, and the updated shard is then gathered into every rank's weights.

    Under tensor parallelism (the model's `tp`) the parameters are this rank's slices, and under pipeline parallelism
    (`pp`) those of its stages, stepped as any others; only the gradient norm looks across the ranks (`_layout_norm`).
    """

    def __init__(self, model: nn.Module, training: Training, knobs: Knobs = Knobs(), placement=None):
        self.placement = placement  # memory/placement.py: where gradients and weights are (None: all on the device)
        self.parallel = placement.parallel if placement is not None else None
        self.device = placement.device if placement is not None else next(model.parameters()).device
        num_layers = len(model.blocks) if hasattr(model, "blocks") else 0
        cpu_steps = offloaded_groups(knobs, "offload_optimizer", num_layers)
        host_masters = offloaded_groups(knobs, "offload_master", num_layers)
        # knobs.stream_masters: these blocks' parameters point at their fp32 masters between uses (offload.py)
        self.master_streamed = master_streamed_groups(knobs, num_layers)
        groups = [{"params": named, "layer": layer, "decay": [p.ndim >= 2 for _, p in named],
                   "on_cpu": layer in cpu_steps}
                  for layer, named in layer_groups(model).items()]
        super().__init__(groups, {"lr": training.lr, "betas": (training.beta1, training.beta2), "eps": EPS,
                                  "weight_decay": training.weight_decay})
        self.clip_coef: torch.Tensor | None = None
        self.seed = training.seed
        self.index = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        self.tp, self.pp = getattr(model, "tp", None), getattr(model, "pp", None)
        self.layout_shares = self._layout_shares()
        self.pieces = {p: piece for group in self.param_groups for p, piece in self._pieces(group).items()}
        largest = max((self.pieces[p].end - self.pieces[p].start for g in self.param_groups if g["on_cpu"]
                       for p in g["params"] if p in self.pieces), default=0)
        self.staging = _Staging(min(largest, CPU_STEP_CHUNK))
        if cpu_steps:
            cpu_adam.load()  # built now, before training starts, if this machine has not built it yet
        self.crosses_pcie = bool(cpu_steps or host_masters)
        # knobs.overlap_cpu_step: one worker thread steps these groups in order (fastml's op releases the GIL)
        self.overlapped = overlapped_groups(knobs, num_layers)
        self._worker = ThreadPoolExecutor(1, "fastml-cpu-step") if self.overlapped else None
        self._stepping: dict[str, Future] = {}  # group -> its pending background step
        if self._worker is not None and placement is not None:
            placement.wait_for_step, placement.finish_steps = self.wait_group, self.finish_steps
        master_dtype = torch.float32 if knobs.master_dtype == "fp32" else torch.bfloat16
        state_dtype = DTYPES[knobs.optimizer_dtype]
        compensated = knobs.master_dtype == "bf16_kahan"
        self.steps_with_fastml_op = knobs.uses_fastml_adamw
        if self.steps_with_fastml_op and self.device.type == "cuda":
            native.load_cuda()
        for group in self.param_groups:
            on_cpu = group["on_cpu"]
            states_at = torch.device("cpu") if on_cpu else self.device
            master_at = torch.device("cpu") if group["layer"] in host_masters else self.device
            for p in group["params"]:
                if p in self.pieces:
                    self.state[p] = self._initial_state(self._weight(group, p), master_dtype, state_dtype,
                                                        master_at, states_at,
                                                        pin=not on_cpu and self.device.type == "cuda",
                                                        count_on_host=on_cpu or self.steps_with_fastml_op,
                                                        compensated=compensated,
                                                        weight_is_master=group["layer"] in self.master_streamed)

    def _pieces(self, group: dict) -> dict[nn.Parameter, Piece]:
        """The part of each parameter of `group` this rank steps: all of it, or where its shard cuts it."""
        params = group["params"]
        layout = Layout.of({name: p.shape for name, p in zip(group["param_names"], params)}, 1)
        if self.parallel is not None and self.parallel.scatter:
            layout = self.parallel.layouts[group["layer"]]
        return {params[piece.index]: piece for piece in layout.pieces(*layout.range_of(self._rank))}

    @property
    def _rank(self) -> int:
        return self.parallel.world.rank if self.parallel is not None and self.parallel.scatter else 0

    @staticmethod
    def _initial_state(weight: torch.Tensor, master_dtype: torch.dtype, state_dtype: torch.dtype,
                       master_at: torch.device, states_at: torch.device, pin: bool, count_on_host: bool,
                       compensated: bool, weight_is_master: bool) -> dict:
        """`weight_is_master`: `weight` is the fp32 master itself, the host copy of a block whose masters are
        streamed (knobs.stream_masters): kept as the state's master all the same, so that checkpoints hold the same
        tensors whichever way the masters live."""
        if weight_is_master:
            master = weight
        elif weight.dtype == master_dtype:
            master = None
        elif master_at.type == "cpu" and pin:  # host masters a GPU step reads: pinned, for fast asynchronous copies
            master = pinned_empty(weight.numel(), master_dtype, cuda=True).view(weight.shape).copy_(weight)
        else:
            master = weight.to(device=master_at, dtype=master_dtype, copy=True)
        like = weight if master is None else master
        # Fused AdamW reads its step count on the device; foreach AdamW and fastml's op read it on the host.
        state = {"step": torch.zeros((), dtype=torch.float32, device="cpu" if count_on_host else states_at),
                 "exp_avg": torch.zeros_like(like, dtype=state_dtype, device=states_at),
                 "exp_avg_sq": torch.zeros_like(like, dtype=state_dtype, device=states_at)}
        if master is not None:
            state["master"] = master
        elif compensated:  # zero: the bf16 weights are the exact masters where training starts
            state["master_low"] = torch.zeros_like(weight, device=states_at)
        return state

    def _weight(self, group: dict, p: nn.Parameter) -> torch.Tensor:
        """The weights of `p` this rank updates, where they live: the parameter itself (its host copy while it is
        streamed), its slice, or its slice of a sharded block's weight shard."""
        piece = self.pieces[p]
        if self.parallel is not None and group["layer"] in self.parallel.sharded:
            shard = self.parallel.shards[group["layer"]]
            return _as_piece(shard[piece.offset:piece.offset + piece.end - piece.start], p, piece)
        return _as_piece(p.detach().view(-1)[piece.start:piece.end], p, piece)

    def _master(self, group: dict, p: nn.Parameter) -> torch.Tensor:
        """What the step updates: the fp32 master, or the weights where they are their own masters."""
        state = self.state[p]
        return state["master"] if "master" in state else self._weight(group, p)

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def _grad(self, group: dict, p: nn.Parameter) -> tuple[torch.Tensor | None, bool]:
        """The step's gradient of this rank's piece of `p`, and whether it is in host memory (not clipped yet)."""
        piece = self.pieces[p]
        if self.parallel is not None and self.parallel.scatter:
            shard, on_host = self.parallel.grad_shard(group["layer"])
            if shard is None:
                return None, False
            return _as_piece(shard[piece.offset:piece.offset + piece.end - piece.start], p, piece), on_host
        host = self.placement.host_grad(p) if self.placement is not None else None
        return (host, True) if host is not None else (p.grad, False)

    def gradient(self, p: nn.Parameter) -> torch.Tensor | None:
        """What the step reads of `p`'s gradient on this rank, once the backward passes are complete (None where this
        rank steps no part of it): the gradient, or its piece of a sharded group's gradient shard."""
        self._finish_backward()
        group = next(group for group in self.param_groups if any(q is p for q in group["params"]))
        return self._grad(group, p)[0] if p in self.pieces else None

    def _finish_backward(self) -> None:
        if self.placement is not None:
            self.placement.finish_backward()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s arithmetic, over gradients wherever they are: the norm of each
        gradient on the GPU (those in host memory had theirs taken before they left, placement.grad_norms), the norm
        of those norms in parameter order, and the GPU gradients scaled in place. Gradients in host memory are
        scaled by `clip_coef` when they are stepped. Sharded, each rank takes the norm of its shards and the ranks
        add their squares. Returns the norm before clipping."""
        self._finish_backward()
        grads = {p: g for group in self.param_groups for p in group["params"] if p in self.pieces
                 for g, on_host in [self._grad(group, p)] if g is not None and not on_host}
        norms = dict(zip(grads, torch._foreach_norm(list(grads.values()), 2))) if grads else {}
        if self.placement is not None:
            norms.update(self.placement.grad_norms)
        ordered = [norms[p] for group in self.param_groups for p in group["params"] if p in norms]
        if self.layout_shares is not None:
            total = self._layout_norm(norms)
        elif self.parallel is not None and self.parallel.scatter:
            total = self._sharded_norm(ordered + list(self.parallel.shard_norms.values()))
        elif not ordered:
            self.clip_coef = None
            return 0.0
        else:
            total = torch.linalg.vector_norm(torch.stack([n.to(ordered[0].device) for n in ordered]), 2)
        self.clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(list(grads.values()), self.clip_coef.to(self.device))
        return total.item()

    def _layout_shares(self) -> dict[nn.Parameter, float] | None:
        """Under tensor or pipeline parallelism, the share of each parameter's squared gradient norm this rank counts:
        a tensor-parallel group's ranks hold slices of most parameters (each counts its own) and the whole of a few,
        the norms, whose gradients are the same on every rank (each counts 1 / size); the last pipeline stage holds a
        copy of an embedding tied to its LM head, counted by the first (0 here). None otherwise."""
        tp, pp = self.tp, self.pp
        if not (tp is not None and tp.active or pp is not None and pp.active):
            return None
        named = [(name, p) for group in self.param_groups for name, p in zip(group["param_names"], group["params"])]
        return {p: 0.0 if pp.active and not pp.first and name == "embed.weight" else
                1 / tp.size if tp.replicated(name) else 1.0 for name, p in named}

    def _layout_norm(self, norms: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor:
        """The norm over every rank's share (`_layout_shares`) of the gradients: sharded, every rank's squares add up;
        otherwise those of the first data-parallel rank's groups (the others hold the same gradients)."""
        ordered = [norms[p] for group in self.param_groups for p in group["params"] if p in norms]
        shares = [self.layout_shares[p] for group in self.param_groups for p in group["params"] if p in norms]
        squares = torch.stack([n.to(ordered[0].device).float() for n in ordered]) ** 2 if ordered else None
        local = (squares * torch.tensor(shares, device=squares.device)).sum().item() if ordered else 0.0
        scattered = self.parallel is not None and self.parallel.scatter
        if scattered:
            local += self._host_shares_squared()
        rows = [row[0] for row in agree([local])]
        world = World(size=len(rows), tensor=self.tp.size, pipeline=self.pp.size)
        counted = [row for rank, row in enumerate(rows) if scattered or world.holds_data_rank_0(rank)]
        return torch.tensor(sum(counted), dtype=torch.float32, device=self.device).sqrt()

    def _host_shares_squared(self) -> float:
        """This rank's share of the squared norm of its gradient shards in host memory: each shard's squared norm
        (taken on the device, `parallel.shard_norms`), less the part of it a parameter with a share below 1 does not
        count (read on the host: the norms' weights, a few elements)."""
        total = 0.0
        for group in self.param_groups:
            norm = self.parallel.shard_norms.get(group["layer"])
            if norm is None:
                continue
            total += norm.item() ** 2
            for p in group["params"]:
                if p in self.pieces and self.layout_shares[p] != 1.0:
                    total -= (1 - self.layout_shares[p]) * self._grad(group, p)[0].float().square().sum().item()
        return total

    def _sharded_norm(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """The norm of every rank's shard norms, from each rank's norm of its own."""
        local = torch.linalg.vector_norm(torch.stack(norms), 2).item() if norms else 0.0
        ranks = torch.tensor([row[0] for row in agree([local])], dtype=torch.float32)
        return torch.linalg.vector_norm(ranks, 2).to(self.device)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Steps every group. With knobs.overlap_cpu_step the groups that step on the CPU go to the worker thread in
        order, their inputs taken now, and `step` returns without waiting for them (`wait_group`, `wait`)."""
        if closure is not None:
            raise ValueError("this AdamW takes no closure: the training loop computes the loss before the step")
        self._finish_backward()
        # The groups stepped in the background go last: the others' steps (and gathers) are done by then, so the two
        # threads never step at once (they share the staging buffers).
        for group in sorted(self.param_groups, key=lambda group: group["layer"] in self.overlapped):
            cpu_work = []
            for decays in (True, False):
                params = [p for p, d in zip(group["params"], group["decay"])
                          if d == decays and p in self.pieces and self._grad(group, p)[0] is not None]
                if not params:
                    continue
                weight_decay = group["weight_decay"] if decays else 0.0
                if group["on_cpu"]:
                    cpu_work.append(self._cpu_step(group, params, weight_decay))
                else:
                    self._step(group, params, weight_decay)
            if group["layer"] in self.overlapped:  # no gather to follow (`overlapped_groups`); submitted even with
                # no piece of it here, so that every rank meets the others at its barrier
                clipped = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" \
                    else None
                self._stepping[group["layer"]] = self._worker.submit(self._in_background, group["layer"], cpu_work,
                                                                     clipped)
                continue
            for work in cpu_work:
                work()
            if self.parallel is not None:
                if self.staging.stream is not None:  # the CPU step's weights, written back on the side stream
                    torch.cuda.current_stream().wait_stream(self.staging.stream)
                self.parallel.gather_updated(group["layer"], self.placement.host_flat(group["layer"]))
        if self.parallel is not None and not self._stepping:
            self.placement.settle()  # knobs.share_host_weights: the other ranks' shards of the host copy stepped too
        if not self._stepping:
            self.wait()

    def _in_background(self, layer: str, work: list, clipped) -> object:
        """Group `layer`'s CPU step on the worker thread (whose grad mode and CUDA device are its own); returns the
        event after which its weights written back to the GPU have arrived, or None. Its copies run on the staging
        stream, after the compute stream's `clipped` event (the gradients clipped): on the compute stream they would
        queue behind the next step's forward pass, which waits for them."""
        if clipped is None:  # a CPU plan: no streams
            with torch.no_grad():
                for step in work:
                    step()
            self._settle_in_background()
            return None
        stream = self.staging.stream_on(self.device)
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(clipped)
            for step in work:
                step()
            self._settle_in_background()
            return stream.record_event()

    def _settle_in_background(self) -> None:
        """A group whose host copy the node's ranks share (sharded states): its step is done once every rank's is.
        The worker is then the only thread at the node's barrier (the step's own `settle` waits for no group)."""
        if self.parallel is not None:
            self.placement.settle()

    def wait_group(self, layer: str) -> None:
        """Waits for the background step of group `layer`, if one is pending, and has the compute stream wait for
        the weights it sent to the GPU. An error of that step is raised here."""
        future = self._stepping.pop(layer, None)
        if future is None:
            return
        sent = future.result()
        if sent is not None:
            torch.cuda.current_stream(self.device).wait_event(sent)

    def finish_steps(self) -> None:
        """Waits for every group's background step (the forward pass waits for each in its place: `wait_group`)."""
        for layer in list(self._stepping):
            self.wait_group(layer)

    def wait(self) -> None:
        """Waits until the step is complete everywhere: the background steps, and the copies written without
        blocking, on any stream, that the host reads next (checkpoints, evaluation)."""
        self.finish_steps()
        if self.device.type == "cuda" and self.crosses_pcie:
            torch.cuda.synchronize(self.device)  # copies written without blocking, on any stream, are complete

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.parallel is not None:
            self.parallel.zero_grad()

    def close(self) -> None:
        """Finishes the step and stops the worker thread of knobs.overlap_cpu_step (the end of a run)."""
        self.wait()
        if self._worker is not None:
            self._worker.shutdown()

    def _step(self, group: dict, params: list[torch.Tensor], weight_decay: float) -> None:
        """The step on the training device; master weights, gradients or weights kept in host memory come over
        and what changed goes back."""
        states = [self.state[p] for p in params]
        homes = [self._master(group, p) for p in params]
        masters = [m.to(self.device, non_blocking=True) for m in homes]  # the same tensor where it is here
        beta1, beta2 = group["betas"]
        rounded_in_step = set()
        if self.steps_with_fastml_op:  # one parameter at a time, reading bf16 gradients as they are
            for p, master, state in zip(params, masters, states):
                state["step"] += 1
                step = int(state["step"])
                # beside an fp32 master, the weight on this device is rounded in the same pass, not read back after
                weight = self._weight(group, p) if "master" in state else None
                weight_out = weight if weight is not None and weight.device == master.device else None
                if weight_out is not None:
                    rounded_in_step.add(p)
                cpu_adam.adamw_step_(master, state["exp_avg"], state["exp_avg_sq"], self._device_grad(group, p),
                                     weight_out, group["lr"], beta1, beta2, group["eps"], weight_decay, step,
                                     seed=self.rounding_seed(p, step), offset=self.pieces[p].start,
                                     master_low=state.get("master_low"))
        else:
            grads = [self._device_grad(group, p, m.dtype) for p, m in zip(params, masters)]
            fused = self.device.type == "cuda"
            adamw(
                masters, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
                [s["step"] for s in states], foreach=not fused, fused=fused, amsgrad=False, beta1=beta1,
                beta2=beta2, lr=group["lr"], weight_decay=weight_decay, eps=group["eps"], maximize=False)
        for home, master in zip(homes, masters):
            if home is not master:
                home.copy_(master, non_blocking=True)
        rounded = [(self._weight(group, p), m) for p, m, s in zip(params, masters, states)
                   if "master" in s and p not in rounded_in_step]
        resident = [(w, m) for w, m in rounded if w.device == m.device]
        if resident:
            torch._foreach_copy_(*map(list, zip(*resident)))
        for w, m in rounded:
            if w.device != m.device:  # a streamed weight: rounded here, then to its host copy
                w.copy_(m.to(w.dtype))

    def _device_grad(self, group: dict, p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The clipped gradient of `p` on the training device, in `dtype` (default: its own): one kept in host
        memory comes over and is clipped here as the GPU's own gradients were."""
        grad, on_host = self._grad(group, p)
        if on_host:
            grad = grad.to(self.device, non_blocking=True)
            if self.clip_coef is not None:
                grad.mul_(self.clip_coef.to(grad.device))
        return grad if dtype is None else grad.to(dtype)  # a copy only where the dtypes differ

    def rounding_seed(self, p: nn.Parameter, step: int) -> int:
        """The seed of the stochastic rounding of `p`'s step `step`: one per run seed, parameter and step."""
        return ((self.seed * 1_000_003 + self.index[p]) * 1_000_000_007 + step) % 2**63

    def _cpu_step(self, group: dict, params: list[torch.Tensor], weight_decay: float):
        """The step in host memory with the C++ AdamW, parameter by parameter, as a function to call; what the loop
        changes after the step (the gradients, the clip coefficient, the learning rate) is taken now, so that it may
        run after the loop has moved on (knobs.overlap_cpu_step); masters, m and v are the optimizer's own. A
        gradient, master or weight on the GPU comes over and goes back around it in slices of CPU_STEP_CHUNK elements
        through reused pinned buffers (`_Staging`), so that the host needs little memory beyond the tensors that live
        there."""
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        scale = self.clip_coef.item() if self.clip_coef is not None else 1.0
        grads = [self._grad(group, p) for p in params]

        def step() -> None:
            for p, (grad, on_host) in zip(params, grads):
                self._cpu_step_param(p, group, grad, scale if on_host else 1.0, lr, beta1, beta2, eps, weight_decay)
        return step

    def _cpu_step_param(self, p: nn.Parameter, group: dict, grad: torch.Tensor, grad_scale: float, lr: float,
                        beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        """One parameter's CPU step; `grad_scale` clips a gradient in host memory (those on the GPU are clipped)."""
        state = self.state[p]
        state["step"] += 1
        step = int(state["step"])
        master = self._master(group, p)
        # The rounded weights: into the host copy of a streamed weight, or over to the GPU; none where the host copy
        # is the master (the fetch rounds it)
        weight = self._weight(group, p) if "master" in state and group["layer"] not in self.master_streamed else None
        flat = [t.reshape(-1) if t is not None else None
                for t in (master, state["exp_avg"], state["exp_avg_sq"], grad, weight, state.get("master_low"))]
        offset = self.pieces[p].start
        for start in range(0, flat[0].numel(), CPU_STEP_CHUNK):
            master_s, m_s, v_s, grad_s, weight_s, low_s = [t[start:start + CPU_STEP_CHUNK] if t is not None else None
                                                           for t in flat]
            self.staging.begin_slice()
            master_here, grad_here = self.staging.fetch(master_s), self.staging.fetch(grad_s)
            weight_here = self.staging.slot(weight_s) if weight_s is not None else None
            cpu_adam.adamw_step_(master_here, m_s, v_s, grad_here, weight_here, lr, beta1, beta2, eps, weight_decay,
                                 step, grad_scale, seed=self.rounding_seed(p, step), offset=offset + start,
                                 master_low=low_s)
            self.staging.send(master_here, master_s)
            if weight_here is not None:
                self.staging.send(weight_here, weight_s)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a resumed run needs, by parameter name: master weights (where the parameters are not their own)
        or their compensation (master_dtype "bf16_kahan"), and Adam's m, v and step, of this rank's piece of each
        parameter (`state_ranges` says which part, where it
        is not all of it)."""
        self.wait()
        tensors = {}
        for name, state in self._named_states():
            for key, value in state.items():
                tensors[f"{key}/{name}"] = value
        return tensors

    def state_ranges(self) -> dict[str, tuple[int, int]]:
        """For each tensor of `state_tensors` that holds part of its parameter: the elements [start, end) of the
        flattened parameter it holds."""
        ranges = {}
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                piece = self.pieces.get(p)
                if piece is not None and (piece.start, piece.end) != (0, p.numel()):
                    for key in self.state[p]:
                        if key != "step":
                            ranges[f"{key}/{name}"] = (piece.start, piece.end)
        return ranges

    @torch.no_grad()
    def load_state(self, read) -> None:
        """Sets the state from a checkpoint's: `read(key, start, end)` returns elements [start, end) of the flattened
        tensor `key` (e.g. "exp_avg/embed.weight"), or None where the checkpoint has none (one written before the
        first step has no Adam state)."""
        self.wait()
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                piece = self.pieces.get(p)
                for key, value in self.state.get(p, {}).items():
                    whole = key == "step"
                    saved = read(f"{key}/{name}", 0 if whole else piece.start, 1 if whole else piece.end)
                    if saved is not None:
                        value.copy_(saved.reshape(value.shape))

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """`load_state` from whole tensors by name."""
        self.load_state(lambda key, start, end: tensors[key].reshape(-1)[start:end] if key in tensors else None)

    def _named_states(self):
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                if p in self.state:
                    yield name, self.state[p]


def _as_piece(flat: torch.Tensor, p: nn.Parameter, piece: Piece) -> torch.Tensor:
    """A piece's elements shaped as its parameter where it is the whole parameter (so that the state of a run
    without sharding has the parameters' shapes), else flat."""
    return flat.view(p.shape) if (piece.start, piece.end) == (0, p.numel()) else flat


class _Staging:
    """Pinned host buffers through which the CPU step reads and writes GPU tensors, a slice (at most CPU_STEP_CHUNK
    elements) at a time: reused, since a fresh host allocation per slice would fault in every page; written back
    to the GPU on a side stream without blocking, so that the next slice's arithmetic runs meanwhile, each buffer
    reused only once its copy is done (SLOTS buffers per dtype). Host tensors pass through untouched. The planner
    counts these buffers (planner/memory.py, `_cpu_staging_bytes`)."""

    def __init__(self, numel: int):
        self.numel = numel  # the largest slice the step stages
        self.buffers: dict[torch.dtype, list[tuple[torch.Tensor, list]]] = {}
        self.turn: dict[torch.dtype, int] = {}
        self.taken: dict[torch.dtype, int] = {}  # buffers handed out for the slice being stepped
        self.stream = None

    def begin_slice(self) -> None:
        self.taken.clear()

    def slot(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like `like`: `like` itself where it is in host memory, else a free pinned buffer."""
        if like.device.type == "cpu":
            return like
        self.taken[like.dtype] = self.taken.get(like.dtype, 0) + 1
        if self.taken[like.dtype] > STAGING_SLOTS:  # the turn would come round to a buffer this slice still uses
            raise RuntimeError(f"the CPU step stages more than {STAGING_SLOTS} {like.dtype} tensors of one slice")
        slots = self.buffers.setdefault(like.dtype, [])
        if len(slots) < STAGING_SLOTS:
            slots.append((pinned_empty(self.numel, like.dtype, cuda=True), [None]))
        turn = self.turn[like.dtype] = (self.turn.get(like.dtype, -1) + 1) % len(slots)
        buffer, done = slots[turn]
        if done[0] is not None:
            done[0].synchronize()  # its last copy to the GPU has finished
            done[0] = None
        return buffer[:like.numel()].view(like.shape)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in host memory: itself, or a copy in a staging buffer."""
        here = self.slot(t)
        if here is not t:
            here.copy_(t)  # device to host: returns once the copy is done
        return here

    def stream_on(self, device: torch.device):
        """The side stream the staging buffers are written back on (made on first use)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def send(self, here: torch.Tensor, there: torch.Tensor) -> None:
        """Writes back a staging buffer to the GPU tensor it stands for, without waiting (on the side stream, after
        what the current stream has queued: on the worker of an overlapped step that is the side stream itself)."""
        if here is there:
            return
        self.stream_on(there.device).wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            there.copy_(here, non_blocking=True)
        done = next(done for buffer, done in self.buffers[here.dtype] if buffer.data_ptr() == here.data_ptr())
        done[0] = self.stream.record_event()


def lr_at(step: int, training: Training) -> float:
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step (steps - 1)."""
    if step < training.warmup_steps:
        return training.lr * (step + 1) / training.warmup_steps
    decay_steps = max(1, training.steps - 1 - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / decay_steps)
    floor = training.lr * training.min_lr_ratio
    return floor + (training.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
