"""Token data for training: a prepared dataset's format (`Header`) and `TokenData`, its training batches.

A prepared dataset (prepare.py makes one) is a directory holding two files:
  tokens.bin   every document's token ids followed by the end-of-document id, all concatenated; raw little-endian
               uint16 when the vocabulary fits in 16 bits, else uint32
  header.json  the `Header`: {"format": "fastml-tokens", "version": 1, "dtype": "uint16" | "uint32", "num_tokens",
               "num_documents", "vocab_size", "eos_id", "tokenizer", "sources"}
and, where it was prepared with one, its validation split in `validation/`, a dataset of the same format that
training never reads (`TokenData.open_validation`). Training memory-maps tokens.bin, so a corpus larger than RAM costs
no RAM.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from fastml.config import UserError, check_range, fail, first_line, from_dict

FORMAT = "fastml-tokens"
FORMAT_VERSION = 1
HEADER_FILE = "header.json"
TOKENS_FILE = "tokens.bin"
VALIDATION_DIR = "validation"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
PREPARE_HINT = "run `fastml prepare` to make a dataset"

@dataclass(frozen=True, kw_only=True)
class Header:
    """header.json of a prepared dataset."""

    format: Literal["fastml-tokens"]
    version: int
    dtype: Literal["uint16", "uint32"]
    """The type of each token id in tokens.bin, little-endian."""
    num_tokens: int
    num_documents: int
    vocab_size: int
    eos_id: int
    """The id that ends each document."""
    tokenizer: str
    """"bytes", or the path of the HF tokenizer.json."""
    sources: tuple[str, ...]
    """The files the documents came from."""

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            fail("version", f"{self.version} is not supported; this fastml reads version {FORMAT_VERSION}")
        for name in ("num_tokens", "num_documents", "vocab_size", "eos_id"):
            check_range(name, getattr(self, name), 0)
        check_range("eos_id", self.eos_id, 0, self.vocab_size, high_open=True)


# ---------------------------------------------------------------------------------------------------- tokenizers


class TokenData:
    """A prepared dataset, memory-mapped and cut into windows of seq_len + 1 tokens for next-token prediction.

    Window w holds tokens [w * seq_len, (w + 1) * seq_len + 1): windows share one token, the last target of one
    being the first input of the next, so every token but the first is a target exactly once per epoch.
    """

    def __init__(self, path: Path, header: Header, tokens: np.ndarray, seq_len: int, vocab_size: int | None = None):
        self.path = path
        self.header = header
        self.tokens = tokens  # (num_tokens,) memmap
        self.seq_len = seq_len
        self.vocab_size = vocab_size  # the model's: batches refuse larger ids, from a damaged tokens.bin
        self.num_tokens = len(tokens)
        self.num_windows = (self.num_tokens - 1) // seq_len

    @classmethod
    def open(cls, data: str | Path, seq_len: int, vocab_size: int) -> TokenData:
        """`data` is a directory made by `prepare`, or "default" for the default corpus."""
        if seq_len < 1:
            fail("seq_len", f"{seq_len} must be at least 1")
        path = _default_corpus() if str(data) == "default" else Path(data).expanduser()
        header = read_header(path)
        _check_fits(path, header, seq_len, vocab_size)
        tokens = np.memmap(path / TOKENS_FILE, dtype=DTYPES[header.dtype], mode="r", shape=(header.num_tokens,))
        return cls(path, header, tokens, seq_len, vocab_size)

    @classmethod
    def open_validation(cls, data: str | Path, seq_len: int, vocab_size: int) -> TokenData | None:
        """The validation split of dataset `data` (as `open` takes it), or None where it was prepared without one."""
        path = validation_path(data)
        return None if path is None else cls.open(path, seq_len, vocab_size)

    def fixed_batches(self, batch_size: int, num_sequences: int, rank: int = 0,
                      world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `num_sequences` windows in order (the same every time), rank r's every world_size-th from r, in
        (inputs, targets) batches of `batch_size`: num_sequences must be a multiple of batch_size x world_size."""
        import torch  # here, not at the top: `fastml prepare` and the data checks run without it

        _check_batch_args(batch_size, 0, 0, rank, world_size)
        if num_sequences % (batch_size * world_size) or not 0 < num_sequences <= self.num_windows:
            fail("num_sequences", f"{num_sequences} must be a positive multiple of {batch_size * world_size} and at "
                                  f"most the {self.num_windows} sequences of {self.path}")
        batches = []
        for windows in np.arange(rank, num_sequences, world_size).reshape(-1, batch_size):
            batches.append(inputs_and_targets(torch.from_numpy(self.rows(windows))))
        return batches

    def batches(
        self, batch_size: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless (inputs, targets) int64 tensors, each (batch_size, seq_len); targets are inputs shifted by one.

        Epoch e visits the windows in the order `default_rng((seed, e)).permutation(num_windows)`; the stream of
        all epochs is cut into micro-batches of batch_size * world_size windows and rank r takes slice r of each.
        `start` micro-batches are skipped in O(1), so a resumed run continues where it stopped.
        """
        _check_batch_args(batch_size, seed, start, rank, world_size)
        # Not a generator itself, so bad arguments raise here rather than at the first next().
        return self._iter_batches(batch_size, seed, start, rank, world_size)

    def _iter_batches(self, batch_size: int, seed: int, start: int, rank: int, world_size: int):
        import torch

        orders = _EpochOrders(self.num_windows, (seed,))
        for first in _firsts(batch_size, start, rank, world_size):
            windows = orders.windows_at(np.arange(first, first + batch_size))
            yield inputs_and_targets(torch.from_numpy(self.rows(windows)))

    def rows(self, windows: np.ndarray) -> np.ndarray:
        """The (len(windows), seq_len + 1) int64 tokens of `windows`, their ids checked."""
        positions = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        rows = np.asarray(self.tokens[positions], dtype=np.int64)
        self._check_ids(rows, positions)
        return rows

    def _check_ids(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """On the CPU, where it costs a max over the batch: on a GPU an id beyond the vocabulary is a device assert
        that kills the process without saying where the bad token is."""
        if self.vocab_size is None or rows.max(initial=0) < self.vocab_size:
            return
        index = np.argmax(rows >= self.vocab_size)  # the first, in row-major order
        fail("", f"data {self.path}: token id {rows.flat[index]} at position {positions.flat[index]} of {TOKENS_FILE} "
                 f"is beyond the model's vocabulary of {self.vocab_size}; {PREPARE_HINT} again")


def inputs_and_targets(rows):
    """(inputs, targets) of (B, seq_len + 1) token rows: (B, seq_len) each, the targets the inputs shifted by one."""
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _firsts(batch_size: int, start: int, rank: int, world_size: int) -> Iterator[int]:
    """The position in the endless stream of sequences where rank `rank`'s slice of each micro-batch begins, from
    micro-batch `start` on: the stream is cut into micro-batches of batch_size x world_size, rank r taking slice r."""
    for micro_batch in itertools.count(start):
        yield micro_batch * batch_size * world_size + rank * batch_size


BLEND_BLOCK = 1024
"""A blend's sequences come in blocks of this many, in each of which every dataset has its weight's share."""


class BlendedData:
    """Several datasets, each sequence of the stream from one of them: in every block of BLEND_BLOCK sequences,
    dataset d has round(weight_d x BLEND_BLOCK) of them (largest remainders: they add up to the block), in an order
    drawn from (seed, block); within a dataset, its sequences come in its own epochs' orders (seeded (seed, d)).
    So the shares hold within one sequence per block, and a resumed run finds any position without reading what came
    before it (O(1), as TokenData)."""

    def __init__(self, parts: list[TokenData], weights: list[float]):
        self.parts, self.seq_len = parts, parts[0].seq_len
        self.per_block = _largest_remainders(np.asarray(weights) / sum(weights), BLEND_BLOCK)
        self._blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    @property
    def shares(self) -> list[float]:
        """Each dataset's share of the sequences, as drawn."""
        return (self.per_block / BLEND_BLOCK).tolist()

    def batches(self, batch_size: int, seed: int, start: int = 0, rank: int = 0,
                world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """As TokenData.batches, over the blend."""
        _check_batch_args(batch_size, seed, start, rank, world_size)
        return self._iter_batches(batch_size, seed, start, rank, world_size)

    def _iter_batches(self, batch_size: int, seed: int, start: int, rank: int, world_size: int):
        import torch

        orders = [_EpochOrders(part.num_windows, (seed, d)) for d, part in enumerate(self.parts)]
        for first in _firsts(batch_size, start, rank, world_size):
            datasets, indices = self.sources(np.arange(first, first + batch_size), seed)
            rows = np.empty((batch_size, self.seq_len + 1), dtype=np.int64)
            for d in np.unique(datasets):
                mine = datasets == d
                rows[mine] = self.parts[d].rows(orders[d].windows_at(indices[mine]))
            yield inputs_and_targets(torch.from_numpy(rows))

    def sources(self, positions: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """For each position of the stream, its dataset and the position in that dataset's own stream."""
        blocks, offsets = np.divmod(positions, BLEND_BLOCK)
        datasets, indices = np.empty_like(positions), np.empty_like(positions)
        for block in np.unique(blocks):
            labels, before = self._block(seed, int(block))
            here = blocks == block
            datasets[here] = labels[offsets[here]]
            indices[here] = block * self.per_block[datasets[here]] + before[offsets[here]]
        return datasets, indices

    def _block(self, seed: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The datasets of a block's sequences, and how many of the same dataset come before each in the block."""
        if (seed, block) not in self._blocks:
            if len(self._blocks) >= 2:  # positions only grow
                del self._blocks[min(self._blocks)]
            labels = np.repeat(np.arange(len(self.parts)), self.per_block)
            np.random.default_rng((seed, len(self.parts), block)).shuffle(labels)
            before = np.empty(BLEND_BLOCK, dtype=np.int64)
            for d in range(len(self.parts)):
                before[labels == d] = np.arange(self.per_block[d])
            self._blocks[(seed, block)] = labels, before
        return self._blocks[(seed, block)]


def _largest_remainders(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts in proportion to `shares` that add up to `total`: floors, then one more for the largest
    remainders."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact)[:total - counts.sum()]] += 1
    return counts


def open_training_data(data, seq_len: int, vocab_size: int) -> TokenData | BlendedData:
    """A plan's `training.data`: one dataset (a directory or "default"), or a blend of weighted ones."""
    if isinstance(data, (str, Path)):
        return TokenData.open(data, seq_len, vocab_size)
    parts = [TokenData.open(part.path, seq_len, vocab_size) for part in data]
    made_by = {(p.header.tokenizer, p.header.eos_id) for p in parts}
    if len(made_by) > 1:
        fail("training.data", f"a blend's datasets must share one tokenizer; these were prepared with "
                              f"{' and '.join(sorted(str(t) for t, _ in made_by))}")
    return BlendedData(parts, [part.weight for part in data])


def _check_batch_args(batch_size: int, seed: int, start: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        fail("batch_size", f"{batch_size} must be at least 1")
    if seed < 0:
        fail("seed", f"{seed} must be a non-negative integer")
    if start < 0:
        fail("start", f"{start} must be non-negative")
    if world_size < 1 or not 0 <= rank < world_size:
        fail("rank", f"{rank} must be in [0, {world_size}) with world_size >= 1")


class _EpochOrders:
    """Maps positions in the endless window stream to windows; keeps the permutations of the latest epochs. `key`
    seeds them: (seed,) for a dataset alone, (seed, i) for dataset i of a blend."""

    def __init__(self, num_windows: int, key: tuple[int, ...]):
        self.num_windows = num_windows
        self.key = key
        self._orders: dict[int, np.ndarray] = {}

    def windows_at(self, positions: np.ndarray) -> np.ndarray:
        epochs, indices = np.divmod(positions, self.num_windows)
        windows = np.empty_like(positions)
        for epoch in np.unique(epochs):  # more than one when a micro-batch spans an epoch boundary
            in_epoch = epochs == epoch
            windows[in_epoch] = self._order(int(epoch))[indices[in_epoch]]
        return windows

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # positions only grow, so the oldest epoch is done with
                del self._orders[min(self._orders)]
            self._orders[epoch] = np.random.default_rng((*self.key, epoch)).permutation(self.num_windows)
        return self._orders[epoch]


def validation_path(data) -> Path | None:
    """Where dataset `data` (a directory, or "default") keeps its validation split; None where it has none. A blend's
    is its first dataset's that has one."""
    if not isinstance(data, (str, Path)):
        return next(filter(None, (validation_path(part.path) for part in data)), None)
    path = (_default_corpus() if str(data) == "default" else Path(data).expanduser()) / VALIDATION_DIR
    return path if (path / HEADER_FILE).is_file() else None


def tokenizer_of_data(data) -> str:
    """The tokenizer a plan's `training.data` was prepared with ("bytes", or an HF tokenizer.json's path): a blend's
    first dataset's."""
    first = Path(data if isinstance(data, (str, Path)) else data[0].path)
    return "bytes" if str(first) == "default" else read_header(first.expanduser()).tokenizer  # the default corpus'


def read_header(path: Path) -> Header:
    """The validated header.json of the dataset at `path`."""
    if not path.is_dir():
        fail("", f"data {path} is not a directory; {PREPARE_HINT}")
    try:
        header = json.loads((path / HEADER_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        fail("", f"data {path} has no {HEADER_FILE}; {PREPARE_HINT}")
    except (OSError, ValueError, RecursionError) as e:
        fail("", f"data {path}: {HEADER_FILE} is not readable JSON ({first_line(e)}); {PREPARE_HINT}")
    try:
        return from_dict(Header, header)
    except UserError as e:
        fail("", f"data {path}: {HEADER_FILE} is malformed: {e}; {PREPARE_HINT}")


def _check_fits(path: Path, header: Header, seq_len: int, vocab_size: int) -> None:
    num_tokens = header.num_tokens
    expected_bytes = num_tokens * DTYPES[header.dtype].itemsize
    try:
        actual_bytes = (path / TOKENS_FILE).stat().st_size
    except FileNotFoundError:
        fail("", f"data {path} has no {TOKENS_FILE}; {PREPARE_HINT}")
    if actual_bytes != expected_bytes:
        fail("", f"data {path}: {TOKENS_FILE} has {actual_bytes} bytes but {HEADER_FILE} says {num_tokens} "
                 f"{header.dtype} tokens ({expected_bytes} bytes); {PREPARE_HINT} again")
    if header.vocab_size > vocab_size:
        fail("", f"data {path} was tokenized with vocab size {header.vocab_size} but the model has {vocab_size}")
    if num_tokens < seq_len + 1:
        fail("", f"data {path} has {num_tokens} tokens but one sequence of seq_len {seq_len} needs {seq_len + 1}")


def _default_corpus() -> Path:
    from fastml.executor.storage.prepare import default_corpus  # prepare.py writes this module's format: imported late

    return default_corpus()
