"""The validation split (`fastml prepare --validation-fraction`, `--validation`) and the validation loss a run
evaluates (executor/loop/evaluate.py). The loss is checked against an independent evaluation: the run's final
checkpoint loaded into a plain model, every sequence of the split's first `eval_tokens` cut out of tokens.bin here and
their cross-entropy taken in one batch. fp32 on a CPU: the two differ only in the order of the sums (micro-batches
and ranks against one batch), so they agree to fp32 rounding over a few thousand terms, rel 1e-5 (the 2-rank job's
own check is in tests/test_distributed.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fastml.config import UserError
from fastml.plan import Hardware, Knobs, Plan, Training
from fastml.weights import training_checkpoints
from fastml.executor.loop.train import train
from fastml.executor.model.transformer import Transformer
from fastml.executor.storage.data import VALIDATION_DIR, TokenData
from fastml.executor.storage.prepare import ByteTokenizer, prepare
from fastml.executor.storage.tensordir import MODEL_FILE
from small_model import SMALL

SEQ_LEN, SEQUENCES = 32, 8


def documents(count: int) -> list[str]:
    """`count` distinct documents of a few dozen words each."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import", "(x)", "for", "in", "range"]
    return [f"doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(20, 60)))) for i in range(count)]


def write_jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def tokens_of(texts: list[str]) -> list[int]:
    return [t for text in texts for t in [*text.encode("utf-8"), ByteTokenizer.eos_id]]


def read_tokens(path: Path) -> list[int]:
    return np.fromfile(path / "tokens.bin", dtype="<u2").tolist()


def test_a_fraction_of_the_documents_is_held_out_evenly_spaced(tmp_path):
    texts = documents(200)
    header = prepare([write_jsonl(tmp_path / "d.jsonl", texts)], tmp_path / "out", progress=False,
                     validation_fraction=0.05)
    held = [texts[i] for i in range(19, 200, 20)]  # floor((i + 1) x 0.05) passes an integer at i = 19, 39, ...
    kept = [t for i, t in enumerate(texts) if (i + 1) % 20]
    assert read_tokens(tmp_path / "out" / VALIDATION_DIR) == tokens_of(held)
    assert read_tokens(tmp_path / "out") == tokens_of(kept)
    assert header["num_documents"] == 190
    validation = json.loads((tmp_path / "out" / VALIDATION_DIR / "header.json").read_text())
    assert validation["num_documents"] == 10 and validation["num_tokens"] == len(tokens_of(held))


def test_validation_files_are_held_out_whole(tmp_path):
    train_texts, held = documents(30), ["held out one", "held out two"]
    prepare([write_jsonl(tmp_path / "a.jsonl", train_texts)], tmp_path / "out", progress=False,
            validation_inputs=[write_jsonl(tmp_path / "v.jsonl", held)])
    assert read_tokens(tmp_path / "out") == tokens_of(train_texts)
    assert read_tokens(tmp_path / "out" / VALIDATION_DIR) == tokens_of(held)


def test_a_validation_file_the_inputs_also_match_is_held_out_once(tmp_path):
    train_texts, held = documents(30), ["held out one", "held out two"]
    write_jsonl(tmp_path / "a.jsonl", train_texts)
    prepare([str(tmp_path / "*.jsonl")], tmp_path / "out", progress=False,
            validation_inputs=[write_jsonl(tmp_path / "v.jsonl", held)])
    assert read_tokens(tmp_path / "out") == tokens_of(train_texts)
    assert read_tokens(tmp_path / "out" / VALIDATION_DIR) == tokens_of(held)


def test_an_empty_validation_split_is_refused(tmp_path):
    with pytest.raises(UserError, match="the validation split is empty: a fraction of 0.01 of 30 document"):
        prepare([write_jsonl(tmp_path / "a.jsonl", documents(30))], tmp_path / "out", progress=False,
                validation_fraction=0.01)
    assert not (tmp_path / "out").exists()


def test_a_dataset_without_a_split_has_no_validation(tmp_path):
    prepare([write_jsonl(tmp_path / "a.jsonl", documents(30))], tmp_path / "out", progress=False)
    assert TokenData.open_validation(tmp_path / "out", SEQ_LEN, SMALL.vocab_size) is None


def test_the_default_corpus_holds_out_a_validation_split():
    validation = TokenData.open_validation("default", SEQ_LEN, SMALL.vocab_size)
    assert validation is not None and validation.num_windows > 100


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """400 documents, a tenth of them held out: about 1,400 validation sequences of SEQ_LEN."""
    root = tmp_path_factory.mktemp("validated")
    prepare([write_jsonl(root / "d.jsonl", documents(400))], root / "data", progress=False, validation_fraction=0.1)
    return root / "data"


def validated_plan(data: Path, checkpoints: Path, ranks: int = 1, steps: int = 4, **knobs) -> Plan:
    """The small model in fp32 on `data`, evaluated every 2 steps on 1,024 tokens, checkpointed at the end."""
    micro = 2
    return Plan(model=SMALL, training=Training(seq_len=SEQ_LEN, global_batch_tokens=SEQ_LEN * SEQUENCES, steps=steps,
                                               data=str(data), eval_interval=2, eval_tokens=32 * SEQ_LEN,
                                               checkpoint_dir=str(checkpoints)),
                hardware=Hardware(device="cpu", num_gpus=ranks, gpus_per_node=ranks),
                knobs=Knobs(micro_batch_size=micro, grad_accum_steps=SEQUENCES // (micro * ranks),
                            param_dtype="fp32", matmul_dtype="fp32", **knobs))


def independent_loss(checkpoints: Path, data: Path, sequences: int) -> float:
    """The mean next-token loss of the final checkpoint's weights over the validation split's first `sequences`
    windows, computed here in one batch."""
    model = Transformer(SMALL)
    model.load_state_dict(load_file(training_checkpoints(checkpoints)[-1] / MODEL_FILE))
    tokens = np.fromfile(data / VALIDATION_DIR / "tokens.bin", dtype="<u2").astype(np.int64)
    rows = torch.from_numpy(np.stack([tokens[w * SEQ_LEN:(w + 1) * SEQ_LEN + 1] for w in range(sequences)]))
    with torch.no_grad():
        logits = model.logits(rows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()


def val_losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in map(json.loads, log.read_text().splitlines()) if "val_loss" in r}


def test_the_validation_loss_is_the_final_weights_loss_on_the_same_sequences(tmp_path, dataset):
    log = tmp_path / "log.jsonl"
    summary = train(validated_plan(dataset, tmp_path / "ck"), log_json=log, show_progress=False)
    losses = val_losses(log)
    assert list(losses) == [2, 4]  # every eval_interval steps, the last included
    assert summary["val_loss"] == losses[4]
    assert losses[4] == pytest.approx(independent_loss(tmp_path / "ck", dataset, 32), rel=1e-5)


def test_fewer_eval_tokens_than_a_round_evaluate_one_micro_batch_of_every_rank(tmp_path, dataset):
    p = validated_plan(dataset, tmp_path / "ck")
    p = dataclasses.replace(p, training=dataclasses.replace(p.training, eval_tokens=SEQ_LEN))
    log = tmp_path / "log.jsonl"
    train(p, log_json=log, show_progress=False)
    assert val_losses(log)[4] == pytest.approx(independent_loss(tmp_path / "ck", dataset, 2), rel=1e-5)


def test_a_split_shorter_than_a_micro_batch_is_skipped_with_a_note(tmp_path, capsys):
    prepare([write_jsonl(tmp_path / "d.jsonl", documents(100))], tmp_path / "data", progress=False,
            validation_inputs=[write_jsonl(tmp_path / "v.jsonl", ["tiny"])])
    log = tmp_path / "log.jsonl"
    summary = train(validated_plan(tmp_path / "data", tmp_path / "ck"), log_json=log, show_progress=False)
    assert val_losses(log) == {} and summary["val_loss"] is None
    assert "note: no validation loss: the validation split" in " ".join(capsys.readouterr().err.split())


def test_evaluating_changes_no_step_of_the_training(tmp_path, dataset):
    """Evaluations after every step, between the steps of a plan that streams its weights, offloads its block inputs
    and steps its optimizer on the host (whose placement a forward pass without gradients could leave in another
    state): the training losses are those of the same run evaluated only at the end, bit for bit."""
    offload = dict(offload_weights=1.0, offload_residuals=1.0, offload_optimizer=1.0, offload_master=1.0,
                   offload_gradients=1.0, recompute=("block",))
    losses = {}
    for interval in (1, 0):
        p = validated_plan(dataset, tmp_path / f"ck{interval}", **offload)
        p = dataclasses.replace(p, training=dataclasses.replace(p.training, eval_interval=interval))
        log = tmp_path / f"log{interval}.jsonl"
        train(p, log_json=log, show_progress=False)
        losses[interval] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        assert len(val_losses(log)) == (4 if interval else 1)
    assert losses[1] == losses[0]
