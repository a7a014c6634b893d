"""Blended datasets (`training.data` as a list of weighted datasets, executor/storage/data.py's BlendedData): the
shares over 10k sequences, the order's determinism and exact resumption, the plan contract, and a run that reports
each dataset's share. Each dataset here is written in one letter, so a sequence says which it came from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from fastml.config import UserError, from_dict, to_dict
from fastml.plan import Training, WeightedData
from fastml.executor.loop.train import train
from fastml.executor.storage.data import BLEND_BLOCK, BlendedData, open_training_data
from fastml.executor.storage.prepare import prepare
from test_validation import validated_plan

SEQ_LEN = 32
LETTERS = "abc"
WEIGHTS = [0.6, 0.3, 0.1]


@pytest.fixture(scope="module")
def letters(tmp_path_factory) -> list[Path]:
    """Three datasets, each of documents in one letter."""
    root = tmp_path_factory.mktemp("letters")
    paths = []
    for letter in LETTERS:
        (root / f"{letter}.jsonl").write_text("".join(json.dumps({"text": letter * (50 + i)}) + "\n"
                                                      for i in range(40)))
        prepare([str(root / f"{letter}.jsonl")], root / letter, progress=False)
        paths.append(root / letter)
    return paths


def blend(paths: list[Path], weights=WEIGHTS) -> tuple[WeightedData, ...]:
    return tuple(WeightedData(path=str(p), weight=w) for p, w in zip(paths, weights))


def source_letters(inputs) -> list[str]:
    """The letter of each sequence (its first token that is not an end of document)."""
    return [chr(next(t for t in row.tolist() if t < 256)) for row in inputs]


def drawn(data: BlendedData, sequences: int, seed: int = 3, start: int = 0, batch: int = 100):
    batches = data.batches(batch, seed, start=start)
    return [next(batches)[0] for _ in range(sequences // batch)]


def test_a_blend_hits_its_weights_within_1_percent_over_10k_sequences(letters):
    data = open_training_data(blend(letters), SEQ_LEN, 257)
    got = [letter for inputs in drawn(data, 10_000) for letter in source_letters(inputs)]
    shares = [got.count(letter) / len(got) for letter in LETTERS]
    assert shares == pytest.approx(WEIGHTS, abs=0.01)
    assert data.shares == pytest.approx(WEIGHTS, abs=1 / BLEND_BLOCK)


def test_a_blend_resumes_bit_exactly_and_its_order_follows_the_seed(letters):
    data = open_training_data(blend(letters), SEQ_LEN, 257)
    whole = drawn(data, 3_000)
    resumed = drawn(open_training_data(blend(letters), SEQ_LEN, 257), 1_800, start=12)
    assert all(np.array_equal(a, b) for a, b in zip(whole[12:], resumed, strict=True))
    other_seed = drawn(data, 3_000, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(whole, other_seed))


def test_ranks_take_their_slices_of_one_blended_stream(letters):
    data = open_training_data(blend(letters), SEQ_LEN, 257)
    alone = next(data.batches(8, 3))[0]
    ranks = [next(data.batches(4, 3, rank=r, world_size=2))[0] for r in range(2)]
    assert np.array_equal(np.concatenate(ranks), alone)


def test_a_blend_in_the_plan_contract():
    training = Training(data=blend([Path("x"), Path("y")], [2.0, 1.0]))
    assert from_dict(Training, to_dict(training)) == training
    with pytest.raises(UserError, match="training.data: 'x' is listed twice"):
        Training(data=blend([Path("x"), Path("x")], [1.0, 1.0]))
    with pytest.raises(UserError, match="weight"):
        from_dict(Training, {"data": [{"path": "x", "weight": 0}]})
    with pytest.raises(UserError, match="data: expected a string or a list, got int"):
        from_dict(Training, {"data": 3})


def test_a_run_on_a_blend_reports_each_datasets_share(tmp_path, letters, capsys):
    plan = validated_plan(letters[0], tmp_path / "ck", steps=2)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, data=blend(letters)))
    summary = train(plan, show_progress=False)
    assert summary["data_shares"] == {str(p): pytest.approx(w, abs=1 / BLEND_BLOCK) for p, w in zip(letters, WEIGHTS)}
    said = " ".join(capsys.readouterr().out.split())  # as printed, unwrapped
    assert f"data: a blend, of each block of 1,024 sequences: {letters[0]} {summary['data_shares'][str(letters[0])]:.1%}" \
        in said
