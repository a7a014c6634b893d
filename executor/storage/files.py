"""Files of datasets and checkpoints. Directories appear under their name complete or not at all, so a crash never
leaves half a dataset or checkpoint behind: written into a hidden sibling (same filesystem, so the rename is atomic),
fsynced, renamed; and they disappear the same way. A process killed midway leaves its hidden sibling behind, named
after its host and pid, for `remove_leftovers` to find once that process is gone. Tensors are read and written as safetensors only: a pickle can
run arbitrary code when loaded."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fastml.config import UserError, fail, read_json

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


def remove_dir(directory: Path) -> None:
    """Deletes `directory` after renaming it to a hidden sibling: a crash midway never leaves a half-deleted directory
    under the real name, where it would pass for a damaged one."""
    doomed = _sibling(directory, "deleted")
    os.rename(directory, doomed)
    shutil.rmtree(doomed)


def _sibling(directory: Path, kind: str) -> Path:
    # The host and pid tell which process left it behind, should one crash (remove_leftovers).
    return directory.with_name(f".{directory.name}.{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:tmp|old|deleted)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}")


def remove_leftovers(parent: Path) -> list[tuple[Path, int]]:
    """Removes the hidden siblings in `parent` that `write_dir_atomically` and `remove_dir` left behind in processes
    of this host that are no longer running (killed midway); returns each with its size in bytes. A running
    process's (another run writing a checkpoint) stay, and so do those of other hosts sharing the directory: their
    processes cannot be seen from here, and a run on that host removes them."""
    removed = []
    for path in sorted(parent.iterdir()) if parent.is_dir() else ():
        match = _LEFTOVER.fullmatch(path.name)
        if match and match["host"] == socket.gethostname() and not is_running(int(match["pid"])):
            num_bytes = _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append((path, num_bytes))
    return removed


def is_running(pid: int) -> bool:
    """Whether a process of this host (of this PID namespace) has the id `pid`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def _tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (the path itself, if a file)."""
    if not path.is_dir():
        return path.lstat().st_size
    return sum(Path(d, name).lstat().st_size for d, _, names in os.walk(path) for name in names)


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


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
    fsync(path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError  # here: reading a dataset's header needs no torch
    from safetensors.torch import load_file

    if not path.is_file():
        fail(str(path), "missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    # "format": "pt" is what transformers expects in the header of a PyTorch safetensors file.
    save_file({name: compact(t.detach().cpu()) for name, t in tensors.items()}, path,
              metadata={"format": "pt", **(metadata or {})})
    # safetensors writes a private temporary file (mode 0600) and renames it: give it a new file's mode, as the JSON
    # files beside it have.
    os.chmod(path, 0o666 & ~umask())
    fsync(path)


def umask() -> int:
    """This process's umask: read from /proc where there is one, since os.umask reads it only by setting it (for
    every thread at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t` with storage of its own: safetensors refuses tensors that share storage, such as slices of one tensor."""
    import torch

    covers_storage = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.contiguous() if covers_storage else t.clone(memory_format=torch.contiguous_format)
