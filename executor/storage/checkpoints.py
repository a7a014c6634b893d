"""Training snapshots: a run's checkpoints under `checkpoint_dir/step-NNNNNNNN`, written every few steps, the newest
intact one found again after a crash, and restored so that the resumed run takes exactly the steps the lost one would
have.

Each is a fastml checkpoint (tensordir.py: atomic, with a SHA-256 per file) holding the model, the optimizer state
and the RNG states; its manifest names the run that wrote it, the step, the position in the data and the plan. The
data order needs no state of its own: it follows from the seed and the position (data.py).

A checkpoint directory holds one run. A fresh start into a directory that holds checkpoints is refused unless the
user says --start-over, which moves them aside (into `old-run-TIME/` inside the directory; nothing is deleted). A
resumed run keeps its run id, and continues only under a plan that computes the same thing (`resume_changes`).
Pruning keeps the newest `keep` intact checkpoints of this run and touches no other run's. A run starts by removing
what killed processes left in the directory (half-written checkpoints in hidden siblings: files.remove_leftovers).
A run of several nodes first checks that they all see the same directory.

Each rank's random generators start from the training seed plus its rank (`seed_rng`); each rank saves its own states
and restores them, and a rank the checkpoint has none for (one written by fewer ranks) starts them as a new run would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from fastml.config import UserError, fail, show
from fastml.plan import KNOBS, Hardware, Plan, check_init_from, layer_of
from fastml.weights import checkpoint_step, is_fastml_checkpoint, is_hf_model, spec_of_weights, training_checkpoints
from fastml.executor.loop import faults
from fastml.executor.loop.display import size_text
from fastml.executor.storage.files import remove_dir, remove_leftovers
from fastml.executor.storage.hf import hf_weights
from fastml.executor.model.transformer import Transformer, build_model
from fastml.executor.storage.data import tokenizer_of_data
from fastml.executor.storage.tensordir import (MODEL_FILE, TrainingState, check_state_dict, load_tensor_file,
                                       read_manifest, save_checkpoint, verify_checkpoint, write_files)
from fastml.executor.parallel.tensor import TensorParallel
from fastml.executor.parallel.world import SINGLE, World

OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
_ASIDE_PREFIX = "old-run-"

# What a resumed run may change. Everything else in model, training, hardware and knobs is refused: it changes the
# math or the data order, so the run would not continue the one that wrote the checkpoint.
SCHEDULE_FIELDS = ("training.steps", "training.lr", "training.min_lr_ratio", "training.warmup_steps")
"""Applied from the resumed step on, and said (the cosine decay follows training.steps too)."""
FREE_FIELDS = frozenset(
    ["model.name", "training.checkpoint_dir", "training.checkpoint_interval"]
    # Evaluating the validation loss changes no weight.
    + ["training.eval_interval", "training.eval_tokens"]
    # The weights a run started from are in its checkpoints, changed by every step since.
    + ["training.init_from"]
    # Other hardware runs the same math (it breaks bit-exactness, as any other machine does), and so do more or
    # fewer GPUs: each step takes the same sequences (the global batch is fixed), summed in another order.
    + [f"hardware.{f.name}" for f in dataclasses.fields(Hardware)]
    # Where tensors live, what is recomputed, compiled or chunked, how collectives run and how the model is laid out
    # over the GPUs change no value (checkpoints hold whole tensors, cut again for the layout that resumes them).
    + [f"knobs.{name}" for name, info in KNOBS.items() if info.kind in ("recompute", "speed", "offload", "shard",
                                                                         "comm", "layout")]
    # The same sequences in the same order, cut into other micro-batches: the global batch is fixed, so the ranks
    # have consumed whole steps of micro_batch_size x grad_accum_steps x num_gpus sequences, which any new
    # micro-batch size times number of GPUs (a divisor of that product) divides as well.
    + ["knobs.grad_accum_steps", "knobs.micro_batch_size"])
"""Allowed, and said."""


@dataclass(frozen=True)
class Position:
    step: int
    """Optimizer steps done."""
    sequences: int
    """Sequences of the data consumed, by all ranks together (so a run resumes at another number of ranks)."""


Say = Callable[[str], None]


class Run:
    """One run's checkpoints in `plan.training.checkpoint_dir` (none without one): `open_run` makes it."""

    def __init__(self, plan: Plan, run_id: str, keep: int, say: Say, restore_from: Path | None = None,
                 saved: TrainingState | None = None, damaged: frozenset[Path] = frozenset(), world: World = SINGLE):
        self.plan = plan
        self.world = world
        self.root = Path(plan.training.checkpoint_dir) if plan.training.checkpoint_dir else None
        self.run_id = run_id
        self.keep = keep
        self.say = say
        self.restore_from, self.saved = restore_from, saved
        # What is known of this run's checkpoints, so each is verified at most once per process.
        self.intact: set[Path] = {restore_from} if restore_from else set()
        self.damaged: set[Path] = set(damaged)

    def start(self, model: Transformer) -> None:
        """Loads the weights a new run starts from, the plan's training.init_from, into `model`, cast to its dtype,
        each rank its part: called before the optimizer makes its masters of the weights. A resumed run's come from
        its checkpoint (`restore`), and without init_from the model keeps its random weights from the seed."""
        source = self.plan.training.init_from
        if self.restore_from is not None or not source:
            return
        with _weights_at(Path(source), self.plan.model) as read:
            _load_model(model, read)
        self.say(f"starting from the weights of {source}")

    def restore(self, model: Transformer, optimizer) -> tuple[Path | None, Position]:
        """Loads the checkpoint `open_run` chose into `model` and `optimizer` and sets the RNG states; returns it
        and its position, or (None, step 0) for a fresh start."""
        if self.restore_from is None:
            return None, Position(0, 0)
        path, saved = self.restore_from, self.saved
        with _checkpoint_weights(path, self.plan.model) as read:
            _load_model(model, read)
        with _SavedOptimizer(path, self.plan.model) as saved_optimizer:
            optimizer.load_state(_slices_of(saved_optimizer.read, model))
        _restore_rng(path, self.world.rank, self.plan.training.seed)
        ranks = f", written by {saved.world_size} ranks" if saved.world_size != self.world.size else ""
        if saved.world_size < self.world.size:
            ranks += f"; ranks {saved.world_size} and above start their RNG as a new run does, from the seed + rank"
        self.say(f"resumed from {path} (step {saved.step}{ranks})")
        return path, Position(saved.step, saved.sequences)

    def save(self, model: Transformer, optimizer, position: Position) -> Path | None:
        """Writes the checkpoint of `position` (nothing without a checkpoint directory), then prunes."""
        if self.root is None:
            return None
        path = self.root / f"step-{position.step:08d}"
        writer = _run_of(path) if path.exists() and self.world.main else None
        if writer not in (None, self.run_id):
            fail(str(path), f"was written by run {writer}, not by this run ({self.run_id}); two runs are writing "
                            f"into {self.root}: give each its own --checkpoint-dir")
        optimizer.wait()  # the step complete, in host memory too (its CPU work may overlap the next step otherwise)
        state = TrainingState(run_id=self.run_id, step=position.step, sequences=position.sequences, plan=self.plan,
                              world_size=self.world.size)
        model_state = _model_state(model, self.world)  # every rank: sharded groups are gathered
        # Unsharded, every rank holds the same optimizer state and rank 0 writes it; sharded, each writes its own.
        parallel = getattr(optimizer, "parallel", None)
        sharded = parallel is not None and parallel.scatter
        optimizer_file = f"optimizer-{self.world.rank:05d}.safetensors" if sharded else OPTIMIZER_FILE
        optimizer_files = {optimizer_file: _whole_optimizer_state(optimizer, model, sharded)} \
            if self.world.data.main or sharded else {}
        optimizer_files = optimizer_files if self.world.main or sharded else {}
        rank_files = {**optimizer_files, _rng_file(self.world.rank): _rng_tensors()}
        # A sharded rank's ranges are of its tensor-parallel rank's slices, which the reader makes whole.
        metadata = {optimizer_file: {"ranges": json.dumps(optimizer.state_ranges()),
                                     "tensor_parallel": json.dumps([model.tp.size, model.tp.rank])}} \
            if sharded else None
        after_each_file = lambda: faults.kill_if_due("kill-mid-checkpoint", position.step)  # noqa: E731
        if self.world.main:
            save_checkpoint(path, self.plan.model, model_state, training=state, metadata=metadata,
                            tensor_files=rank_files, after_each_file=after_each_file,
                            others=_other_ranks_files if self.world.distributed else None)
        else:
            _write_rank_files(rank_files, metadata, after_each_file)
        if self.world.distributed:
            dist.barrier()  # the checkpoint is in place: no rank goes on before it is
        self.intact.add(path)
        self.damaged.discard(path)
        self.say(f"checkpoint {path}")
        if self.world.main:
            self._prune()
        return path

    def _prune(self) -> None:
        """Keeps the newest `keep` intact checkpoints of this run; removes its older and its damaged ones. Another
        run's, and any whose manifest is unreadable (its run unknown), are left alone."""
        kept = 0
        for path in training_checkpoints(self.root):
            if _run_of(path) != self.run_id:
                continue
            if kept < self.keep and self._is_intact(path):
                kept += 1
                continue
            if path in self.damaged:
                self.say(f"removing damaged checkpoint {path}")
            remove_dir(path)
            self.intact.discard(path)

    def _is_intact(self, path: Path) -> bool:
        if path not in self.intact and path not in self.damaged:
            try:
                verify_checkpoint(path)
                self.intact.add(path)
            except UserError as e:
                self.say(f"warning: checkpoint {path} is damaged: {e}")
                self.damaged.add(path)
        return path in self.intact


def open_run(plan: Plan, *, resume: bool, start_over: bool, keep: int, say: Say, world: World = SINGLE,
             new_interval: bool = False) -> Run:
    """The run that is starting: with `resume`, the one whose newest intact checkpoint is in the plan's
    checkpoint_dir (refused if that checkpoint's plan differs in what `resume_changes` refuses), which keeps its
    checkpoint interval unless `new_interval` (the plan's is one the user gave); else a new one, refused if the
    directory holds checkpoints, unless `start_over` moves them aside. Checks before any work. With several ranks,
    rank 0 decides and the others follow. The run's `plan` is the one it trains."""
    if not world.distributed:
        return _open_run(plan, resume=resume, start_over=start_over, keep=keep, say=say, new_interval=new_interval)
    if world.num_nodes > 1 and plan.training.checkpoint_dir:
        _check_shared(Path(plan.training.checkpoint_dir), world)
    decided = [None]
    if world.main:
        run = _open_run(plan, resume=resume, start_over=start_over, keep=keep, say=say, new_interval=new_interval)
        decided = [(run.run_id, run.restore_from, sorted(run.damaged))]
    dist.broadcast_object_list(decided, src=0)
    if world.main:
        run.world = world
        return run
    run_id, restore_from, damaged = decided[0]
    saved = read_manifest(restore_from).training if restore_from is not None else None  # rank 0 verified it
    if saved is not None and not new_interval:
        plan = _with_interval(plan, saved.plan.training.checkpoint_interval)
    return Run(plan, run_id, keep, say, restore_from=restore_from, saved=saved, damaged=frozenset(damaged),
               world=world)


def _check_shared(root: Path, world: World) -> None:
    """Every node sees the one checkpoint directory: rank 0 writes a token into it and every rank reads it back (a
    node that sees another directory would fail only at the first checkpoint, its files missing from rank 0's)."""
    token = [uuid.uuid4().hex if world.main else None]
    if world.main:
        if root.exists() and not root.is_dir():
            fail(str(root), "exists and is not a directory; give --checkpoint-dir a directory")
        root.mkdir(parents=True, exist_ok=True)
        (root / f".fastml-node-check-{token[0]}").write_text(token[0])
    dist.broadcast_object_list(token, src=0)
    probe = root / f".fastml-node-check-{token[0]}"
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    views = [None] * world.size
    dist.all_gather_object(views, (seen, world.node, socket.gethostname()))
    if world.main:
        probe.unlink()
    blind = [(node, host) for saw, node, host in views if not saw]
    if blind:
        fail(str(root), f"is not one directory that every node shares: node {blind[0][0]} (host {blind[0][1]}) does "
                        f"not see the file rank 0 wrote into it; give every node the same shared directory (a "
                        f"network filesystem mounted at one absolute path: a relative path is relative to each "
                        f"node's working directory)")


def _open_run(plan: Plan, *, resume: bool, start_over: bool, keep: int, say: Say, new_interval: bool) -> Run:
    root = plan.training.checkpoint_dir
    if resume and start_over:
        fail("--start-over", "contradicts --resume: resume continues the run in the checkpoint directory, "
                             "--start-over sets its checkpoints aside and starts a new one; give one of them")
    if not root and (resume or start_over):
        fail("--resume" if resume else "--start-over",
             "needs a checkpoint directory: --checkpoint-dir DIR or training.checkpoint_dir")
    if root:
        for path, num_bytes in remove_leftovers(Path(root)):
            say(f"removed {path} ({size_text(num_bytes)}), left behind by a process killed while it wrote or removed "
                f"a checkpoint")
    found = training_checkpoints(root) if root else []
    if resume:
        if found:
            return _resume(plan, found, keep, say, new_interval)
        fail("--resume", _nothing_to_resume(Path(root)))
    _check_init_from(plan)
    if found:
        if not start_over:
            fail(root, f"holds {_describe(found)} of an earlier run; continue that run with --resume, or start a new "
                       f"one with --start-over (which moves them into a new directory "
                       f"{Path(root) / _ASIDE_PREFIX}TIME)")
        _move_aside(Path(root), found, say)
    return Run(plan, _new_run_id(), keep, say)


def _nothing_to_resume(root: Path) -> str:
    """Why `root` holds no run to resume, and what to do instead."""
    start = "start a run from its weights: `fastml plan"
    if is_fastml_checkpoint(root):
        training = read_manifest(root).training
        if training is not None:
            return (f"{root} is a training checkpoint itself: resume its run with --checkpoint-dir {root.parent}, or "
                    f"{start} --init-from {root}`")
        return (f"{root} is a fastml checkpoint of a model, not of a run (as `fastml convert --from-hf` writes): "
                f"{start} --init-from {root}`, then `fastml run` without --resume")
    if is_hf_model(root):
        return f"{root} is an HF model directory: {start} --model {root}`, then `fastml run` without --resume"
    return f"{root} holds no training checkpoint (step-N) to resume: start the run without --resume"


def _check_init_from(plan: Plan) -> None:
    """The weights a new run starts from are its model's, and whole: before any work (rank 0, for all ranks)."""
    check_init_from(plan)
    source = plan.training.init_from
    if source and is_fastml_checkpoint(source):
        verify_checkpoint(source, [MODEL_FILE])  # a training checkpoint's optimizer state is not read
    elif source:
        try:
            hf_weights(source, plan.model)  # reads its safetensors headers and checks the names
        except UserError as e:
            raise UserError(f"training.init_from: {e} (for random weights instead, plan with --init-from '')") from None


def _resume(plan: Plan, found: list[Path], keep: int, say: Say, new_interval: bool) -> Run:
    runs = sorted({run for run in map(_run_of, found) if run is not None})
    if len(runs) > 1:
        fail(plan.training.checkpoint_dir, f"holds the checkpoints of {len(runs)} runs ({', '.join(runs)}); "
                                           "--resume continues one: move the others' step-* directories elsewhere")
    damaged = set()
    for path in found:
        try:
            saved = verify_checkpoint(path).training
            if saved is None:
                fail(str(path), "is a fastml checkpoint but not a training snapshot (it has no training state)")
        except UserError as e:
            say(f"warning: skipping checkpoint {path}: {e}")
            damaged.add(path)
            continue
        kept = saved.plan.training.checkpoint_interval
        if not new_interval and kept != plan.training.checkpoint_interval:
            plan = _with_interval(plan, kept)
            say(f"resuming with the run's checkpoint interval: {_interval_text(kept)} (--checkpoint-interval N "
                f"changes it)")
        _say_changes(resume_changes(path, saved, plan), saved.step, say)
        return Run(plan, saved.run_id, keep, say, restore_from=path, saved=saved, damaged=frozenset(damaged))
    fail(plan.training.checkpoint_dir, f"none of its {len(found)} checkpoints is intact (see the warnings above); "
                                       "start a new run with --start-over instead of --resume")


def _with_interval(plan: Plan, interval: int) -> Plan:
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, checkpoint_interval=interval))


def _interval_text(interval: int) -> str:
    return "at the end only" if not interval else "every step" if interval == 1 else f"every {interval} steps"


def resume_changes(path: Path, saved: TrainingState, plan: Plan) -> list[tuple[str, object, object]]:
    """The fields in which `plan` differs from the plan of the checkpoint at `path`, as (name, old, new); refuses a
    difference outside SCHEDULE_FIELDS and FREE_FIELDS."""
    changes = []
    for section in ("model", "training", "hardware", "knobs"):
        old, new = getattr(saved.plan, section), getattr(plan, section)
        for f in dataclasses.fields(old):
            name, before, after = f"{section}.{f.name}", getattr(old, f.name), getattr(new, f.name)
            if before == after:
                continue
            if name not in SCHEDULE_FIELDS and name not in FREE_FIELDS:
                fail(name, f"was {show(before)} when {path} was written and is {show(after)} now; resuming would not "
                           f"continue the same run: resume with {show(before)}, or start a new run with --start-over "
                           f"instead of --resume")
            changes.append((name, before, after))
    return changes


def _say_changes(changes: list[tuple[str, object, object]], step: int, say: Say) -> None:
    described = {name: f"{name} {show(before)} -> {show(after)}" for name, before, after in changes}
    schedule = [described[name] for name in SCHEDULE_FIELDS if name in described]
    other = [text for name, text in described.items() if name not in SCHEDULE_FIELDS]
    if schedule:
        say(f"resuming with a changed lr schedule, applied from step {step + 1} on: {', '.join(schedule)}")
    if other:
        say(f"resuming with changes that leave the math and the data order as they were: {', '.join(other)}")


def _run_of(path: Path) -> str | None:
    """The run that wrote the checkpoint at `path`; None when its manifest cannot tell."""
    try:
        training = read_manifest(path).training
    except UserError:
        return None
    return training.run_id if training else None


def _new_run_id() -> str:
    # The time first, so a listing of runs sorts by when they began; the random part tells apart two that began at once.
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def _describe(found: list[Path]) -> str:
    steps = sorted(map(checkpoint_step, found))
    if len(steps) == 1:
        return f"1 checkpoint (step {steps[0]})"
    listed = ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]} to {steps[-1]}"
    return f"{len(steps)} checkpoints (steps {listed})"


def _move_aside(root: Path, found: list[Path], say: Say) -> None:
    """Moves the checkpoints `found` into a new directory `old-run-TIME` of `root` (renames: same filesystem)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = root / f"{_ASIDE_PREFIX}{stamp}"
    suffix = 1
    while aside.exists():  # two fresh starts within a second
        suffix += 1
        aside = root / f"{_ASIDE_PREFIX}{stamp}-{suffix}"
    aside.mkdir()
    for path in found:
        os.rename(path, aside / path.name)
    say(f"--start-over: moved {_describe(found)} of the earlier run to {aside}; delete it when it is no longer needed")


def _model_state(model: Transformer, world: World) -> dict[str, torch.Tensor]:
    """The model's weights by name, whole, on rank 0 (empty elsewhere): a sharded group's gathered from the ranks
    one group at a time and moved to host memory (a collective: every rank calls this). In the model's dtype (the
    embedding's, never streamed): a block whose masters are streamed points at them, fp32, between uses, and is
    saved rounded, as its weights are (the optimizer's state holds the masters)."""
    dtype = model.dtype
    state = {name: t.to(dtype) for name, t in model.state_dict().items()} if world.data.main else {}
    parallel = model.placement.parallel if hasattr(model, "placement") else None
    for group in parallel.layouts if parallel is not None else ():  # in model order, the same on every rank
        if group in parallel.sharded:
            gathered = parallel.full_weights(group)
            if world.data.main:
                state.update({name: t.cpu() for name, t in gathered.items()})
    if model.tp.active and world.data.main:  # the first data-parallel rank's group makes its slices whole
        state = {name: model.tp.join(name, t).cpu() for name, t in state.items()}  # one whole tensor at a time
    state = model.pp.gather_on_first(state)  # every pipeline stage's on rank 0
    return state if world.main else {}


@torch.no_grad()
def _load_model(model: Transformer, read: Callable[[str], torch.Tensor]) -> None:
    """The weights `read(name)` gives into the model, a tensor at a time (every rank reads them; none holds them
    whole), cast to the model's dtype: into this rank's shard of a sharded group, into the host copy of a streamed
    one (its shard of it, where the node's ranks share the copy)."""
    placement = getattr(model, "placement", None)
    parallel = placement.parallel if placement is not None else None
    sharded = parallel.sharded if parallel is not None else frozenset()
    shared = placement.offload.host_weights if placement is not None and placement.offload.node else frozenset()
    dtype = model.dtype  # the model's: a block whose masters are streamed points at them, fp32
    if model.tp.active:  # the checkpoint's whole tensors, cut to this rank's slices
        whole = read
        read = lambda name: model.tp.split(name, whole(name))  # noqa: E731
    for name, tensor in model.state_dict().items():
        group = layer_of(name)
        if group in sharded:
            parallel.load_weights(group, name, read(name))
        elif group in shared:  # the node's one host copy: this rank writes its shard
            placement.offload.write(group, name, read(name).to(dtype))
        else:
            tensor.copy_(read(name).to(dtype))  # rounded as the weights are, whatever keeps them
    if placement is not None:
        placement.settle()


def _whole_optimizer_state(optimizer, model: Transformer, sharded: bool) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors (optim.AdamW.state_tensors), those of slices made whole over the tensor-parallel
    group (a collective over it), every pipeline stage's on rank 0; `sharded`, this rank's pieces as they are (each
    rank writes its own file, which `_SavedOptimizer` reads whole)."""
    tensors = optimizer.state_tensors()
    if model.tp.active and not sharded:  # in host memory as each is made: the device holds one at a time
        tensors = {key: value if key.startswith("step/") else model.tp.join(key.split("/", 1)[1], value).cpu()
                   for key, value in tensors.items()}
    return tensors if sharded else model.pp.gather_on_first(tensors)


def _slices_of(read, model: Transformer):
    """`read` (key, start, end) of a checkpoint's optimizer state as this rank's tensor-parallel slices see it: the
    whole tensor read, cut to this rank's slice, and elements [start, end) of that taken."""
    tp = model.tp
    if not tp.active:
        return read
    shapes = {name: p.shape for name, p in model.named_parameters()}

    def read_slice(key: str, start: int, end: int) -> torch.Tensor | None:
        kind, name = key.split("/", 1)
        if kind == "step" or tp.replicated(name):
            return read(key, start, end)
        shape = tp.whole_shape(name, shapes[name])
        whole = read(key, 0, math.prod(shape))
        return None if whole is None else tp.split(name, whole.view(shape)).reshape(-1)[start:end]
    return read_slice


def load_for_inference(path: str | Path, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The plain model (no recompute, offload or sharding) of a fastml checkpoint or an HF model directory, in
    `dtype` on `device`, for evaluation and generation."""
    spec = spec_of_weights(path, "checkpoint")
    model = build_model(spec).to(dtype).to_empty(device=device)
    with _weights_at(Path(path), spec) as read:
        _load_model(model, read)
    return model.eval()


def tokenizer_of(path: str | Path) -> str | None:
    """The tokenizer the weights at `path` were trained with: for a training checkpoint, its data's (a blend's
    first dataset's; "bytes" for the default corpus), for an HF model directory its tokenizer.json; None where
    unknown (a converted checkpoint)."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return str(path / "tokenizer.json")
    if not is_fastml_checkpoint(path):
        return None
    training = read_manifest(path).training
    return None if training is None else tokenizer_of_data(training.plan.training.data)


@contextlib.contextmanager
def _checkpoint_weights(path: Path, spec):
    """`read(name)` of the weights in the fastml checkpoint at `path`, checked against `spec`."""
    with safe_open(path / MODEL_FILE, framework="pt") as saved:
        shapes = {name: torch.empty(saved.get_slice(name).get_shape(), device="meta") for name in saved.keys()}
        check_state_dict(spec, shapes, str(path / MODEL_FILE))
        yield saved.get_tensor


@contextlib.contextmanager
def _weights_at(path: Path, spec):
    """`read(name)` of the weights a run starts from: a fastml checkpoint's, or an HF model directory's."""
    if is_fastml_checkpoint(path):
        with _checkpoint_weights(path, spec) as read:
            yield read
    else:
        yield hf_weights(path, spec)


def _other_ranks_files(tmp: Path):
    """Rank 0's side of a checkpoint of several ranks: tells the others where to write (before it writes its own
    files), and returns what collects the checksums of theirs."""
    dist.broadcast_object_list([str(tmp)], src=0)

    def written() -> dict[str, str]:
        checksums = [None] * dist.get_world_size()
        dist.gather_object({}, checksums, dst=0)
        return {name: digest for rank_files in checksums for name, digest in rank_files.items()}
    return written


def _write_rank_files(tensor_files: dict, metadata: dict | None, after_each_file) -> None:
    """The other ranks' side: their files into rank 0's temporary directory, their checksums back to it."""
    where = [None]
    dist.broadcast_object_list(where, src=0)
    checksums = write_files(Path(where[0]), tensor_files, {}, metadata, after_each_file)
    dist.gather_object(checksums, None, dst=0)


class _SavedOptimizer:
    """A checkpoint's optimizer state, read by parameter and range from whichever files hold it: optimizer.safetensors
    (whole tensors, from a run whose optimizer was not sharded), or one file per rank, each with ranges of the
    flattened tensors (its metadata says which): a run resumes at any number of ranks, sharded or not. A sharded run
    with tensor parallelism wrote ranges of each tensor-parallel rank's slices (its metadata says which rank's): they
    are made whole as they are read."""

    def __init__(self, path: Path, spec):
        whole = path / OPTIMIZER_FILE
        self.files = [whole] if whole.is_file() else sorted(path.glob("optimizer-*.safetensors"))
        self.spec = spec

    def __enter__(self) -> _SavedOptimizer:
        self.index: dict[tuple[str, int], list[tuple[object, int, int]]] = {}  # (key, tensor rank) -> its parts
        self.handles = [safe_open(f, framework="pt") for f in self.files]
        self.tp = TensorParallel(self.spec)
        for handle in self.handles:
            metadata = handle.metadata() or {}
            ranges = json.loads(metadata.get("ranges", "{}"))
            size, rank = json.loads(metadata.get("tensor_parallel", "[1, 0]"))
            self.tp = TensorParallel(self.spec, size) if size > 1 else self.tp
            for key in handle.keys():
                start, end = ranges.get(key, (0, math.prod(handle.get_slice(key).get_shape())))
                self.index.setdefault((key, rank), []).append((handle, start, end))
        if self.tp.active:  # each rank's slice of each parameter
            self.slice_shapes = {name: p.shape for name, p in build_model(self.spec, self.tp).named_parameters()}
        return self

    def __exit__(self, *exc) -> None:
        self.handles.clear()

    def read(self, key: str, start: int, end: int) -> torch.Tensor | None:
        """Elements [start, end) of the flattened tensor `key`."""
        kind, name = key.split("/", 1)
        if not self.tp.active or kind == "step" or self.tp.replicated(name):
            return self._read_rank(key, 0, start, end)
        shape = self.slice_shapes[name]
        slices = [self._read_rank(key, rank, 0, math.prod(shape)) for rank in range(self.tp.size)]
        if any(part is None for part in slices):
            return None
        return self.tp.join_slices(name, [part.view(shape) for part in slices]).reshape(-1)[start:end]

    def _read_rank(self, key: str, rank: int, start: int, end: int) -> torch.Tensor | None:
        """Elements [start, end) of tensor-parallel rank `rank`'s `key`, from the parts that hold them (each element
        from the first that does: every rank's file holds the same step count)."""
        parts, covered = [], start
        for handle, first, last in sorted(self.index.get((key, rank), ()), key=lambda part: part[1]):
            lo, hi = max(first, covered), min(last, end)
            if lo < hi:
                parts.append(handle.get_tensor(key).reshape(-1)[lo - first:hi - first])
                covered = hi
        if not parts:
            return None
        value = torch.cat(parts)
        if value.numel() != end - start:
            fail(str(self.files[0].parent), f"its optimizer files hold {value.numel()} of the elements "
                                           f"[{start}, {end}) of {key}")
        return value


def _rng_file(rank: int) -> str:
    """Each rank's RNG states are a file of its own; rank 0's has the name of a one-process checkpoint's."""
    return RNG_FILE if rank == 0 else f"rng-{rank:05d}.safetensors"


def seed_rng(seed: int, rank: int) -> None:
    """Starts this rank's random generators (CPU and GPU) as a new run does: the ranks draw differently, and the same
    in every run of the plan. (The model's weights are drawn from a generator of their own, the same on every rank.)"""
    torch.manual_seed(seed + rank)


def _restore_rng(path: Path, rank: int, seed: int) -> None:
    """This rank's RNG states from the checkpoint at `path`; where it has none (written by fewer ranks), as a new run
    starts them."""
    if (path / _rng_file(rank)).is_file():
        _set_rng(load_tensor_file(path, _rng_file(rank)))
    else:
        seed_rng(seed, rank)


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return tensors


def _set_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["cpu"])
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
