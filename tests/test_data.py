"""Tests of executor/storage/prepare.py and data.py: tokenizers, prepare, the default corpus and the batch stream."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastml.config import UserError
from fastml.executor.storage import prepare as preparing
from fastml.executor.storage.data import TokenData
from fastml.executor.storage.prepare import ByteTokenizer, HFTokenizer, default_corpus, load_tokenizer, prepare

EOS = ByteTokenizer.eos_id


def read_tokens(path: Path) -> list[int]:
    return np.fromfile(path / "tokens.bin", dtype="<u2").tolist()


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def write_dataset(path: Path, tokens: np.ndarray, vocab_size: int, **header_overrides) -> Path:
    """A dataset written by hand from the documented format, independent of `prepare`."""
    path.mkdir(parents=True)
    tokens.astype("<u2").tofile(path / "tokens.bin")
    header = {"format": "fastml-tokens", "version": 1, "dtype": "uint16", "num_tokens": len(tokens),
              "num_documents": 1, "vocab_size": vocab_size, "eos_id": 0, "tokenizer": "test", "sources": []}
    header.update(header_overrides)
    (path / "header.json").write_text(json.dumps(header))
    return path


# ---------------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_with_non_ascii():
    tokenizer = load_tokenizer(None)
    text = "héllo wörld ✓ 日本語 🙂\n"
    ids = tokenizer.encode(text)
    assert isinstance(tokenizer, ByteTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.name) == (257, 256, "bytes")
    assert ids.tolist() == byte_ids(text)
    assert tokenizer.decode(np.append(ids, EOS)) == text


def make_hf_tokenizer(path: Path, special_tokens=("<unk>", "</s>")) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=list(special_tokens))
    tokenizer.train_from_iterator(["the cat sat", "the dog ran far", "a cat ran"], trainer)
    tokenizer.save(str(path))
    return path


def test_hf_tokenizer_used_by_prepare(tmp_path):
    from tokenizers import Tokenizer

    tokenizer_path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    reference = Tokenizer.from_file(str(tokenizer_path))
    write_jsonl(tmp_path / "docs.jsonl", [{"text": "the cat sat"}, {"text": "a dog ran"}])
    header = prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", tokenizer=str(tokenizer_path), progress=False)
    eos_id = reference.token_to_id("</s>")
    expected = [reference.token_to_id(w) for w in "the cat sat".split()] + [eos_id]
    expected += [reference.token_to_id(w) for w in "a dog ran".split()] + [eos_id]
    assert read_tokens(tmp_path / "out") == expected
    assert header["vocab_size"] == reference.get_vocab_size(with_added_tokens=True)
    assert header["eos_id"] == eos_id
    assert header["tokenizer"] == str(tokenizer_path.resolve())
    assert header["dtype"] == "uint16"
    assert HFTokenizer(tokenizer_path).decode(expected[:3]) == "the cat sat"


def test_hf_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match="missing.json.*no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("not a tokenizer")
    with pytest.raises(UserError, match="bad.json.*not a valid tokenizer.json"):
        HFTokenizer(tmp_path / "bad.json")
    no_eos = make_hf_tokenizer(tmp_path / "no_eos.json", special_tokens=("<unk>",))
    with pytest.raises(UserError, match="no_eos.json.*no end-of-document token"):
        HFTokenizer(no_eos)


# ---------------------------------------------------------------------------------------------------- prepare


def test_prepare_text_jsonl_parquet(tmp_path):
    sources = tmp_path / "src"
    (sources / "sub").mkdir(parents=True)
    (sources / "a.txt").write_text("ab\nc", encoding="utf-8")
    write_jsonl(sources / "b.jsonl", [{"text": "dé", "id": 1}, {"text": ""}, {"text": "f"}])
    (sources / "b.jsonl").write_text((sources / "b.jsonl").read_text() + "\n")  # a blank line is skipped
    write_parquet(sources / "sub" / "c.parquet", {"text": ["xy", None, "z"], "n": [1, 2, 3]})
    header = prepare([str(sources / "**" / "*"), str(sources / "a.txt")], tmp_path / "out", progress=False)
    expected = byte_ids("ab\nc") + [EOS] + byte_ids("dé") + [EOS] + byte_ids("f") + [EOS]
    expected += byte_ids("xy") + [EOS] + byte_ids("z") + [EOS]
    assert read_tokens(tmp_path / "out") == expected
    assert header == json.loads((tmp_path / "out" / "header.json").read_text())
    assert header == {
        "format": "fastml-tokens", "version": 1, "dtype": "uint16", "num_tokens": len(expected),
        "num_documents": 5, "vocab_size": 257, "eos_id": 256, "tokenizer": "bytes",
        "sources": [str(sources / "a.txt"), str(sources / "b.jsonl"), str(sources / "sub" / "c.parquet")],
    }
    assert (tmp_path / "out" / "tokens.bin").stat().st_size == 2 * len(expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary directory left


def test_large_vocab_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w1 w69999 w65536")
    header = prepare([str(tmp_path / "doc.txt")], tmp_path / "out", str(tmp_path / "tokenizer.json"), progress=False)
    assert (header["dtype"], header["vocab_size"], header["eos_id"]) == ("uint32", 70_001, 70_000)
    assert np.fromfile(tmp_path / "out" / "tokens.bin", dtype="<u4").tolist() == [1, 69_999, 65_536, 70_000]
    token_data = TokenData.open(str(tmp_path / "out"), seq_len=2, vocab_size=70_001)
    assert next(token_data.batches(batch_size=1, seed=0))[0].max() >= 65_536


def test_prepare_uses_the_field_and_shows_progress(tmp_path, capsys, monkeypatch):
    """The bar hears of each file as it starts and of every token written; it draws on stderr only."""
    heard = []
    monkeypatch.setattr(preparing._FileProgress, "start_file", lambda self, path: heard.append(path.name))
    monkeypatch.setattr(preparing._FileProgress, "add_tokens", lambda self, num_tokens: heard.append(num_tokens))
    write_jsonl(tmp_path / "d.jsonl", [{"body": "hi"}])
    (tmp_path / "e.txt").write_text("four")
    header = prepare([str(tmp_path / "d.jsonl"), str(tmp_path / "e.txt")], tmp_path / "out", field="body",
                     progress=True)
    assert header["num_tokens"] == 3 + 5
    names = [h for h in heard if isinstance(h, str)]
    assert names == ["d.jsonl", "e.txt"] and sum(h for h in heard if isinstance(h, int)) == 8
    assert capsys.readouterr().out == ""


def test_prepare_overwrites_an_earlier_dataset_only(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.txt").write_text("second")
    prepare([str(tmp_path / "a.txt")], tmp_path / "out", progress=False)
    prepare([str(tmp_path / "b.txt")], tmp_path / "out", progress=False)
    assert read_tokens(tmp_path / "out") == byte_ids("second") + [EOS]
    (tmp_path / "empty").mkdir()
    prepare([str(tmp_path / "a.txt")], tmp_path / "empty", progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="mine: exists and is not a fastml-tokens dataset"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_losing_publish_keeps_the_winner(tmp_path):
    (tmp_path / "a.txt").write_text("winner")
    (tmp_path / "b.txt").write_text("loser")
    prepare([str(tmp_path / "a.txt")], tmp_path / "out", progress=False)
    preparing._prepare_files([tmp_path / "b.txt"], tmp_path / "out", ByteTokenizer(), "text", False, keep_existing=True)
    assert read_tokens(tmp_path / "out") == byte_ids("winner") + [EOS]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out"]


def test_prepare_errors(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="no file matches '.*nothing-\\*.jsonl'"):
        prepare([str(tmp_path / "nothing-*.jsonl")], out, progress=False)
    with pytest.raises(UserError, match="is a directory; give a pattern"):
        prepare([str(tmp_path)], out, progress=False)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(UserError, match="bad.jsonl:2: not valid JSON"):
        prepare([str(bad_json)], out, progress=False)
    write_jsonl(tmp_path / "nofield.jsonl", [{"text": "ok"}, {"content": "x"}])
    with pytest.raises(UserError, match="nofield.jsonl:2: no field 'text'"):
        prepare([str(tmp_path / "nofield.jsonl")], out, progress=False)
    write_parquet(tmp_path / "nocol.parquet", {"content": ["x"]})
    with pytest.raises(UserError, match="nocol.parquet: no column 'text'"):
        prepare([str(tmp_path / "nocol.parquet")], out, progress=False)
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}])
    with pytest.raises(UserError, match="0 tokens"):
        prepare([str(tmp_path / "empty.*")], out, progress=False)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="latin1.txt: is not UTF-8"):
        prepare([str(tmp_path / "latin1.txt")], out, progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # failed runs leave nothing behind


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    write_parquet(tmp_path / "d.parquet", {"text": ["x"]})
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="d.parquet: .*pip install pyarrow"):
        prepare([str(tmp_path / "d.parquet")], tmp_path / "out", progress=False)


# ---------------------------------------------------------------------------------------------------- TokenData


def test_token_data_open_errors(tmp_path):
    with pytest.raises(UserError, match="missing is not a directory; run `fastml prepare`"):
        TokenData.open(str(tmp_path / "missing"), seq_len=4, vocab_size=300)
    (tmp_path / "noheader").mkdir()
    with pytest.raises(UserError, match="has no header.json; run `fastml prepare`"):
        TokenData.open(str(tmp_path / "noheader"), seq_len=4, vocab_size=300)
    write_dataset(tmp_path / "badheader", np.arange(10), 300, num_tokens="ten")
    with pytest.raises(UserError, match="header.json is malformed: num_tokens: expected int, got 'ten'.*prepare"):
        TokenData.open(str(tmp_path / "badheader"), seq_len=4, vocab_size=300)
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "header.json").write_text("{")
    with pytest.raises(UserError, match="header.json is not readable JSON"):
        TokenData.open(str(tmp_path / "notjson"), seq_len=4, vocab_size=300)
    write_dataset(tmp_path / "big_vocab", np.arange(10), 300)
    with pytest.raises(UserError, match="tokenized with vocab size 300 but the model has 257"):
        TokenData.open(str(tmp_path / "big_vocab"), seq_len=4, vocab_size=257)
    with pytest.raises(UserError, match="has 10 tokens but one sequence of seq_len 10 needs 11"):
        TokenData.open(str(tmp_path / "big_vocab"), seq_len=10, vocab_size=300)
    write_dataset(tmp_path / "short_file", np.arange(10), 300, num_tokens=12)
    with pytest.raises(UserError, match="tokens.bin has 20 bytes but header.json says 12"):
        TokenData.open(str(tmp_path / "short_file"), seq_len=4, vocab_size=300)



@pytest.mark.parametrize("change, message", [
    ({"bogus": 1}, "bogus: unknown key; allowed keys are format, version"),
    ({"format": "other"}, "format: 'other' is not allowed; choose one of 'fastml-tokens'"),
    ({"version": 2}, "version: 2 is not supported; this fastml reads version 1"),
    ({"dtype": "int8"}, "dtype: 'int8' is not allowed; choose one of 'uint16', 'uint32'"),
    ({"num_tokens": True}, "num_tokens: expected int, got True"),
    ({"num_documents": -1}, r"num_documents: -1 is outside the allowed range \[0, inf\)"),
    ({"eos_id": 300}, r"eos_id: 300 is outside the allowed range \[0, 300\)"),
    ({"sources": "a.txt"}, "sources: expected a list, got str"),
])
def test_header_fields_are_checked_one_by_one(tmp_path, change, message):
    write_dataset(tmp_path / "d", np.arange(10), 300, **change)
    with pytest.raises(UserError, match=f"header.json is malformed: {message}.*; run `fastml prepare`") as error:
        TokenData.open(str(tmp_path / "d"), seq_len=4, vocab_size=300)
    assert "\n" not in str(error.value)


SEQ_LEN = 10
NUM_WINDOWS = 10


@pytest.fixture
def counting_data(tmp_path) -> TokenData:
    """Token i is i, so a row's first token names its window: window w starts with w * SEQ_LEN."""
    path = write_dataset(tmp_path / "counting", np.arange(NUM_WINDOWS * SEQ_LEN + 1), 1000)
    return TokenData.open(str(path), seq_len=SEQ_LEN, vocab_size=1000)


def take(iterator, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(iterator) for _ in range(num_batches)]


def windows_of(batches) -> list[int]:
    return [int(row[0]) // SEQ_LEN for inputs, _ in batches for row in inputs]


def test_batches_shapes_and_shifted_targets(counting_data):
    assert (counting_data.num_tokens, counting_data.num_windows) == (101, 10)
    for inputs, targets in take(counting_data.batches(batch_size=3, seed=0), 5):
        assert inputs.shape == targets.shape == (3, SEQ_LEN)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(targets, inputs + 1)  # the tokens count up, so a one-token shift adds one
        assert torch.equal(inputs[:, 0] % SEQ_LEN, torch.zeros(3, dtype=torch.int64))


def test_batches_are_deterministic_and_seeded(counting_data):
    first = take(counting_data.batches(batch_size=4, seed=7), 6)
    again = take(counting_data.batches(batch_size=4, seed=7), 6)
    other = take(counting_data.batches(batch_size=4, seed=8), 6)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert windows_of(first) != windows_of(other)


def test_start_skips_micro_batches(counting_data):
    stream = take(counting_data.batches(batch_size=3, seed=1), 12)
    for start in (1, 4, 9):
        resumed = take(counting_data.batches(batch_size=3, seed=1, start=start), 3)
        assert windows_of(resumed) == windows_of(stream[start : start + 3])


def test_ranks_split_the_single_process_stream(counting_data):
    single = take(counting_data.batches(batch_size=4, seed=3), 8)
    rank0 = take(counting_data.batches(batch_size=2, seed=3, rank=0, world_size=2), 8)
    rank1 = take(counting_data.batches(batch_size=2, seed=3, rank=1, world_size=2), 8)
    for whole, part0, part1 in zip(single, rank0, rank1):
        assert torch.equal(whole[0], torch.cat([part0[0], part1[0]]))
        assert torch.equal(whole[1], torch.cat([part0[1], part1[1]]))


def test_every_window_once_per_epoch(counting_data):
    # Batches of 3 do not divide 10 windows, so micro-batches span epoch boundaries.
    windows = windows_of(take(counting_data.batches(batch_size=3, seed=5), 10))
    epochs = [windows[i : i + NUM_WINDOWS] for i in range(0, len(windows), NUM_WINDOWS)]
    assert all(sorted(epoch) == list(range(NUM_WINDOWS)) for epoch in epochs)
    assert epochs[0] != epochs[1]  # each epoch has its own order


def test_batch_argument_errors(counting_data):
    with pytest.raises(UserError, match="rank"):
        counting_data.batches(batch_size=2, seed=0, rank=2, world_size=2)
    with pytest.raises(UserError, match="batch_size"):
        counting_data.batches(batch_size=0, seed=0)


# ---------------------------------------------------------------------------------------------------- default corpus


def test_default_corpus_is_python_source_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path / "cache"))
    began_s = time.perf_counter()
    path = default_corpus()
    build_s = time.perf_counter() - began_s
    assert path.parent == tmp_path / "cache"
    assert build_s < 10
    tokens_mtime_ns = (path / "tokens.bin").stat().st_mtime_ns

    began_s = time.perf_counter()
    token_data = TokenData.open("default", seq_len=256, vocab_size=257)
    assert time.perf_counter() - began_s < 1.0
    assert token_data.path == path
    assert (path / "tokens.bin").stat().st_mtime_ns == tokens_mtime_ns  # not rebuilt
    assert token_data.header.tokenizer == "bytes"
    assert token_data.num_tokens > 1_000_000

    tokens = np.asarray(token_data.tokens[:2_000_000])
    first_document = ByteTokenizer().decode(tokens[: int(np.argmax(tokens == EOS))])
    compile(first_document, "<stdlib>", "exec")  # valid Python source
    assert "def " in ByteTokenizer().decode(tokens)
