"""Directories that appear under their name complete or not at all, so a crash never leaves half a dataset or
checkpoint behind: written into a hidden sibling (same filesystem, so the rename is atomic), fsynced, renamed."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fastml.config import fail, read_json

T = TypeVar("T")


def write_dir_atomically(directory, write: Callable[[Path], T], is_ours: Callable[[Path], bool], what: str,
                         keep_existing: bool = False) -> T:
    """Runs write(tmp) on a fresh sibling directory, fsyncs all of it, renames it to `directory`; returns write's value.

    An existing `directory` is replaced only if it is empty or `is_ours` (`what` names ours in the error, e.g.
    "a fastml checkpoint"). With `keep_existing`, one of ours is kept instead: it won a race to write the same."""
    # abspath, not resolve(): "." and ".." get a real name for the sibling, and a symlink is replaced, not its target.
    directory = Path(os.path.abspath(directory))
    _check_replaceable(directory, is_ours, what)  # before write(), which can take long
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(directory, "tmp")
    tmp.mkdir()
    try:
        result = write(tmp)
        for dir_path, _, file_names in os.walk(tmp):
            for name in file_names:
                fsync(Path(dir_path, name))
            fsync(Path(dir_path))
        _move_into_place(tmp, directory, is_ours, what, keep_existing)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    fsync(directory.parent)  # makes the rename itself durable
    return result


def _check_replaceable(directory: Path, is_ours: Callable[[Path], bool], what: str) -> None:
    if directory.exists() and not directory.is_dir():
        fail(str(directory), "exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not is_ours(directory):
        fail(str(directory), f"exists and is not {what}; refusing to replace it")


def _move_into_place(tmp: Path, directory: Path, is_ours, what: str, keep_existing: bool) -> None:
    try:
        os.rename(tmp, directory)  # atomic; replaces only a missing or empty directory
        return
    except OSError:
        if not directory.exists():
            raise
    _check_replaceable(directory, is_ours, what)  # checked before writing, but another process may have written since
    if keep_existing:
        return
    # POSIX cannot swap in a non-empty directory in one step, so the old one is renamed aside first: a crash between
    # the two renames leaves it intact at `.{name}.old-*`, never a half-written one under the real name.
    old = _sibling(directory, "old")
    os.rename(directory, old)
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def _sibling(directory: Path, kind: str) -> Path:
    # The pid tells which process left it behind, should one crash.
    return directory.with_name(f".{directory.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync(path: Path) -> None:
    """Flushes a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json_object(path) -> dict:
    """The JSON object in the file at `path`; a one-line UserError naming the file if it is missing or not one."""
    if not Path(path).exists():
        fail(str(path), "missing")
    data = read_json(path, "a JSON object")
    if not isinstance(data, dict):
        fail(str(path), f"expected a JSON object, got {type(data).__name__}")
    return data
