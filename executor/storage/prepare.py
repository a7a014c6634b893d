"""`fastml prepare`: documents (text, jsonl or parquet files) tokenized into one flat token file (the format of
data.py), with a byte tokenizer or an HF `tokenizer.json`; and the default corpus, the Python standard library's
sources, prepared the same way on first use and cached. A dataset only ever appears under its final name complete:
`prepare` writes a hidden sibling directory and renames it into place at the end.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import json
import math
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import numpy as np

from fastml.config import check_range, fail, first_line, to_dict
from fastml.hwprofiles import cache_dir
from fastml.executor.storage.data import (DTYPES, FORMAT, FORMAT_VERSION, HEADER_FILE, PREPARE_HINT, TOKENS_FILE,
                                         VALIDATION_DIR, Header)
from fastml.executor.storage.files import read_json_object, write_dir_atomically

# Documents per tokenizer call: an HF tokenizer encodes a batch on all cores.
_NUM_DOCS_PER_CHUNK = 256
_NUM_PARQUET_ROWS_PER_BATCH = 1024
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")

DEFAULT_CORPUS_MAX_BYTES = 16 * 2**20
DEFAULT_VALIDATION_FRACTION = 0.01
"""Of the default corpus' files, held out for validation."""
# Bump when the default corpus' selection, split or tokenization changes, so caches rebuild.
_DEFAULT_CORPUS_VERSION = 2
# Tests, GUI code and generated tables (encodings/) are poor or platform-dependent text.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "encodings", "__pycache__"}
)



class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes, 256 ends a document. Needs no file, so the default corpus needs no download."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as a uint16 numpy array (not a list: a document may be megabytes)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text of `ids`, end-of-document ids dropped; bytes cut mid-character become U+FFFD."""
        ids = np.asarray(ids)
        return ids[ids != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` read through the `tokenizers` library."""

    def __init__(self, path: str | Path):
        path = Path(path).expanduser()
        if not path.is_file():
            fail(f"tokenizer {path}", "no such file; give the path of a Hugging Face tokenizer.json")
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for every parse error
            fail(f"tokenizer {path}", f"not a valid tokenizer.json ({first_line(e)})")
        self.name = str(path.resolve())
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            fail(f"tokenizer {path}", "has an empty vocabulary")
        # Ids can have gaps; the largest id decides the token dtype, so count up to it.
        self.vocab_size = max(self._tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        if self.vocab_size > 2**32:
            fail(f"tokenizer {path}", f"has token id {self.vocab_size - 1}, beyond the uint32 ids of {TOKENS_FILE}")
        self.eos_id = _find_eos_id(vocab, path)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text as a uint32 numpy array, without BOS/EOS templates: `prepare` adds the eos itself."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _find_eos_id(vocab: dict[str, int], path: Path) -> int:
    for token in _EOS_CANDIDATES:
        if token in vocab:
            return vocab[token]
    fail(f"tokenizer {path}", f"has no end-of-document token; looked for {', '.join(_EOS_CANDIDATES)}")


def load_tokenizer(path: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer for None (or its name, "bytes"), else the HF tokenizer.json at `path`."""
    if path is None or str(path) == ByteTokenizer.name:
        return ByteTokenizer()
    return HFTokenizer(path)


# ---------------------------------------------------------------------------------------------------- prepare


def prepare(
    inputs: list[str],
    output_dir: str | Path,
    tokenizer: str | None = None,
    field: str = "text",
    progress: bool = True,
    validation_fraction: float = 0.0,
    validation_inputs: list[str] = (),
) -> dict:
    """Tokenizes the files matched by `inputs` into a dataset at `output_dir`; returns its header as written.

    `inputs` are paths or glob patterns (`**` recurses). By suffix: `.jsonl` holds one JSON object per line with
    the text under `field`; `.parquet` holds the text in column `field`; any other file is one document.
    Empty documents are skipped. Each document is followed by the tokenizer's eos id.

    A validation split, which training never reads, goes to the dataset's `validation/` (data.VALIDATION_DIR), a
    dataset of the same format: `validation_fraction` of the documents of `inputs`, evenly spaced through them
    (document i when floor((i + 1) x fraction) passes an integer, so every source gives its share), and every
    document of `validation_inputs`.
    """
    check_range("--validation-fraction", validation_fraction, 0.0, 0.5)
    held_out = expand_inputs(validation_inputs) if validation_inputs else []
    files = [f for f in expand_inputs(inputs) if f not in held_out]  # held out whole, never trained on
    return _prepare_files(files, Path(output_dir).expanduser(), load_tokenizer(tokenizer), field, progress,
                          split=Split(validation_fraction, held_out))


@dataclass(frozen=True)
class Split:
    """Which documents go to the validation split: a fraction of the inputs', and all of some files'."""

    fraction: float = 0.0
    files: list[Path] = dataclass_field(default_factory=list)

    @property
    def wanted(self) -> bool:
        return self.fraction > 0 or bool(self.files)

    def held_out(self, index: int) -> bool:
        """Whether document `index` of the inputs (counted over all their files) is a validation document."""
        return math.floor((index + 1) * self.fraction) > math.floor(index * self.fraction)


def expand_inputs(inputs: Iterable[str | Path]) -> list[Path]:
    """The files matched by `inputs`, as absolute paths, sorted, each once."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: set[str] = set()
    for pattern in map(str, inputs):
        expanded = os.path.expanduser(pattern)
        matched_files = [os.path.abspath(m) for m in glob.glob(expanded, recursive=True) if os.path.isfile(m)]
        if not matched_files and os.path.isdir(expanded):
            fail("", f"{pattern!r} is a directory; give a pattern such as '{pattern}/**/*.jsonl'")
        if not matched_files:
            fail("", f"no file matches {pattern!r}")
        files.update(matched_files)
    if not files:
        fail("", "no input files given")
    return [Path(f) for f in sorted(files)]


def is_dataset(path: Path) -> bool:
    """Whether `path` holds a header of this format: true only for a directory `prepare` published."""
    try:
        return read_json_object(Path(path) / HEADER_FILE).get("format") == FORMAT
    except (OSError, ValueError, RecursionError):  # a UserError is a ValueError
        return False


def _prepare_files(files: list[Path], output_dir: Path, tokenizer, field: str, progress: bool,
                   keep_existing: bool = False, split: Split = Split()) -> dict:
    """Refuses to replace anything but an empty directory or an earlier dataset; returns the header."""
    return write_dir_atomically(output_dir, lambda tmp: _write_dataset(files, tmp, tokenizer, field, progress, split),
                                is_dataset, f"a {FORMAT} dataset", keep_existing)


def _write_dataset(files: list[Path], out_dir: Path, tokenizer, field: str, progress: bool,
                   split: Split = Split()) -> dict:
    dtype = "uint16" if tokenizer.vocab_size <= 2**16 else "uint32"
    train = _TokenFile(out_dir, dtype)
    validation = _TokenFile(out_dir / VALIDATION_DIR, dtype) if split.wanted else None
    index = 0
    with _FileProgress(progress, len(files) + len(split.files)) as bar, train, validation or contextlib.nullcontext():
        for path in [*files, *split.files]:
            bar.start_file(path)
            for texts in _chunks(_read_documents(path, field), _NUM_DOCS_PER_CHUNK):
                if path in split.files:
                    held = [True] * len(texts)
                else:
                    held = [split.held_out(i) for i in range(index, index + len(texts))]
                    index += len(texts)
                for target, is_held in ((train, False), (validation, True)):
                    chosen = [text for text, h in zip(texts, held) if h == is_held]
                    if chosen:
                        written = target.write(tokenizer.encode_batch(chosen), tokenizer.eos_id)
                        bar.add_tokens(written)
            bar.end_file()
    if train.num_tokens == 0:
        fail("", f"the inputs hold no text for training: 0 tokens from {len(files)} file(s)")
    if validation is not None and validation.num_tokens == 0:
        fail("", f"the validation split is empty: a fraction of {split.fraction} of {index} document(s) is none; "
                 f"give a larger --validation-fraction or --validation files")
    if validation is not None:
        validation.write_header(tokenizer, [*(files if split.fraction else []), *split.files])
    return train.write_header(tokenizer, files)


class _TokenFile:
    """One split's tokens.bin, written document by document, and then its header."""

    def __init__(self, directory: Path, dtype: str):
        self.directory, self.dtype = directory, dtype
        self.num_tokens = self.num_documents = 0

    def __enter__(self) -> _TokenFile:
        self.directory.mkdir(exist_ok=True)
        self.file = open(self.directory / TOKENS_FILE, "wb")
        return self

    def __exit__(self, *exc_info) -> None:
        self.file.close()

    def write(self, documents: list[np.ndarray], eos_id: int) -> int:
        tokens = _join_with_eos(documents, eos_id, DTYPES[self.dtype])
        self.file.write(tokens.data)
        self.num_tokens += len(tokens)
        self.num_documents += len(documents)
        return len(tokens)

    def write_header(self, tokenizer, sources: list[Path]) -> dict:
        header = to_dict(Header(format=FORMAT, version=FORMAT_VERSION, dtype=self.dtype, num_tokens=self.num_tokens,
                                num_documents=self.num_documents, vocab_size=tokenizer.vocab_size,
                                eos_id=tokenizer.eos_id, tokenizer=tokenizer.name,
                                sources=tuple(str(p) for p in sources)))
        (self.directory / HEADER_FILE).write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
        return header


def _read_documents(path: Path, field: str) -> Iterator[str]:
    """The non-empty documents of one file."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            yield from _read_jsonl(path, field)
        elif suffix == ".parquet":
            yield from _read_parquet(path, field)
        else:
            text = path.read_text(encoding="utf-8")
            if text:
                yield text
    except UnicodeDecodeError as e:
        fail(str(path), f"is not UTF-8 text (byte {e.start} cannot be decoded)")


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                fail(where, f"not valid JSON ({e.msg})")
            if not isinstance(record, dict) or field not in record:
                fail(where, f"no field {field!r} (choose the text field with --field)")
            text = record[field]
            if not isinstance(text, str):
                fail(where, f"field {field!r} holds {type(text).__name__}, not a string")
            if text:
                yield text


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
        import pyarrow.types
    except ImportError:
        fail(str(path), "reading parquet files needs pyarrow: pip install pyarrow")
    try:
        parquet_file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        fail(str(path), f"not a readable parquet file ({first_line(e)})")
    schema = parquet_file.schema_arrow
    if field not in schema.names:
        fail(str(path), f"no column {field!r}; the columns are {', '.join(schema.names)}")
    column_type = schema.field(field).type
    if not (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)):
        fail(str(path), f"column {field!r} holds {column_type}, not strings")
    # Record batches keep memory bounded by the batch, not the file.
    for batch in parquet_file.iter_batches(batch_size=_NUM_PARQUET_ROWS_PER_BATCH, columns=[field]):
        yield from (text for text in batch.column(0).to_pylist() if text)


def _chunks(items: Iterable[str], chunk_size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, chunk_size)):
        yield chunk


def _join_with_eos(documents: list[np.ndarray], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """The documents' ids, each followed by `eos_id`, as one array of `dtype`."""
    out = np.empty(sum(len(d) for d in documents) + len(documents), dtype=dtype)
    position = 0
    for ids in documents:
        out[position : position + len(ids)] = ids
        position += len(ids)
        out[position] = eos_id
        position += 1
    return out


class _FileProgress:
    """A progress bar of files done out of all files and tokens written; draws nothing when disabled."""

    def __init__(self, enabled: bool, num_files: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("prepare"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("files  {task.fields[num_tokens]:,} tokens"),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=Console(stderr=True),  # stdout stays for results
            disable=not enabled,
        )
        self._task = self._progress.add_task("", total=num_files, num_tokens=0)
        self._num_tokens = 0

    def __enter__(self) -> _FileProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._progress.stop()

    def start_file(self, path: Path) -> None:
        self._progress.update(self._task, description=path.name)

    def add_tokens(self, num_tokens: int) -> None:
        self._num_tokens += num_tokens
        self._progress.update(self._task, num_tokens=self._num_tokens)

    def end_file(self) -> None:
        self._progress.advance(self._task)


# ---------------------------------------------------------------------------------------------------- default corpus


def default_corpus() -> Path:
    """The dataset used when no data is given: this machine's Python standard library sources, byte-tokenized.

    Built on first use (about a second) and cached under a name that hashes the file list, so it rebuilds when
    the standard library changes. Processes building it at once are safe: the first rename wins, others keep it.
    """
    files = _stdlib_sources(DEFAULT_CORPUS_MAX_BYTES)
    output_dir = cache_dir() / f"default-corpus-{_corpus_key(files)}"
    if not is_dataset(output_dir):
        paths = [path for path, _ in files]
        _prepare_files(paths, output_dir, ByteTokenizer(), "text", progress=False, keep_existing=True,
                       split=Split(DEFAULT_VALIDATION_FRACTION))
    return output_dir


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_sources(max_bytes: int) -> list[tuple[Path, int]]:
    """The stdlib's `.py` files with their sizes, in a fixed walk order, until `max_bytes` would be passed."""
    root = _stdlib_root()
    files: list[tuple[Path, int]] = []
    num_bytes = 0
    for dir_path, dir_names, file_names in os.walk(root):
        dir_names[:] = sorted(d for d in dir_names if d not in _STDLIB_SKIP_DIRS)  # sorted: a deterministic walk
        for name in sorted(n for n in file_names if n.endswith(".py")):
            path = Path(dir_path, name)
            size = path.stat().st_size
            if num_bytes + size > max_bytes:
                return files
            files.append((path, size))
            num_bytes += size
    if not files:
        fail("data", f"no Python standard library sources under {root} for the default corpus; {PREPARE_HINT}")
    return files


def _corpus_key(files: list[tuple[Path, int]]) -> str:
    root = _stdlib_root()
    digest = hashlib.sha256(f"{_DEFAULT_CORPUS_VERSION}\n{sys.version}\n".encode())
    for path, size in files:
        digest.update(f"{path.relative_to(root)}\t{size}\n".encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------- batches
