"""What `fastml plan` is asked, in one place: the command line builds it, `make_plan` takes it. Light to import
(the CLI's parser reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "tiny"
TINY_SEQ_LEN = 256
DEFAULT_SEQ_LEN = 2048
SEQUENCES_PER_STEP = 16
DEFAULT_TRIALS = 100
RANKING_MODEL = "llama-3.1-8b"
"""The model `fastml plan --hw A,B,...` ranks hardware for when no --model is given: the default tiny model is
launch-bound on every GPU, so its ranking would tell them apart by nothing but price."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What `fastml plan` is asked: each field is one of its options, with the option's default."""

    model: str | None = None
    """A preset name or an HF model directory; None: the model of `init_from`, else DEFAULT_MODEL."""
    init_from: str | None = None
    """The weights the run starts from (training.init_from): an HF model directory or a fastml checkpoint; None: an
    HF model directory's own weights where `model` names one, else random ones."""
    seq_len: int | None = None
    """Default: TINY_SEQ_LEN for tiny, else DEFAULT_SEQ_LEN."""
    global_batch_tokens: int | None = None
    """Default: SEQUENCES_PER_STEP sequences per GPU."""
    steps: int = 100
    data: str = "default"
    hw: str | None = None
    """A profile name or JSON file; None: this machine, whose plans keep to the knobs the executor runs."""
    gpus: int | None = None
    nodes: int | None = None
    gpu_mem: str | None = None
    host_mem: str | None = None
    """Default: the profile's; for this machine, its physical memory."""
    device: str | None = None
    """Without hw: "cpu" or "cuda" of this machine (default: its GPU if it has one)."""
    measure: bool = True
    """Without hw, on a GPU machine without a measured profile: measure it first (the quick profile, cached);
    False plans with the shipped profile of its GPU."""
    trials: int = DEFAULT_TRIALS
    study: str | None = None
    lower_precision: bool | None = None
    """None tries full precision first and allows fp8 and bf16 states only if nothing fits without them."""
    overrides: tuple[str, ...] = ()
    """SECTION.FIELD=VALUE pins."""

    def seq_len_for(self, model_name: str) -> int:
        return self.seq_len or (TINY_SEQ_LEN if model_name == "tiny" else DEFAULT_SEQ_LEN)
