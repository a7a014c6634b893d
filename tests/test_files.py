"""Tests of executor/storage/files.py: atomic directory replacement, its races and fsyncs, and JSON reading."""

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from fastml.config import UserError
from fastml.executor.storage import files
from fastml.executor.storage.files import read_json_object, remove_leftovers, write_dir_atomically


def is_ours(directory: Path) -> bool:
    return (directory / "ours").is_file()


def write_file(name: str, text: str):
    def write(tmp: Path) -> str:
        (tmp / name).write_text(text)
        return text
    return write


def rival_publishes(out: Path, name: str):
    """A write() during which another process publishes its own directory at `out`: our rename then loses."""
    def write(tmp: Path) -> None:
        out.mkdir()
        (out / name).write_text("theirs")
        (tmp / "ours").write_text("mine")
    return write


@pytest.mark.parametrize("keep_existing,expected", [(True, "theirs"), (False, "mine")])
def test_losing_rename_keeps_or_replaces_ours(tmp_path, keep_existing, expected):
    write_dir_atomically(tmp_path / "out", rival_publishes(tmp_path / "out", "ours"), is_ours, "ours", keep_existing)
    assert (tmp_path / "out" / "ours").read_text() == expected
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # neither the temporary nor the old directory is left


def test_refuses_to_replace_what_is_not_ours(tmp_path):
    with pytest.raises(UserError, match="out: exists and is not a thing of ours; refusing to replace it"):
        write_dir_atomically(tmp_path / "out", rival_publishes(tmp_path / "out", "notes"), is_ours, "a thing of ours")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes"]
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="file: exists and is not a directory"):
        write_dir_atomically(tmp_path / "file", write_file("ours", ""), is_ours, "ours")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]


def test_files_temporary_dir_and_parent_are_fsynced(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(files, "fsync", synced.append)
    assert write_dir_atomically(tmp_path / "new" / "out", write_file("ours", "x"), is_ours, "ours") == "x"
    tmp = synced[1]
    assert synced == [tmp / "ours", tmp, tmp_path / "new"] and tmp.name.startswith(".out.tmp-")


def test_read_json_object_errors_are_one_line(tmp_path):
    for text, message in [(None, "missing"), ("{", "not valid JSON"), ("[1]", "expected a JSON object, got list")]:
        if text is not None:
            (tmp_path / "x.json").write_text(text)
        with pytest.raises(UserError, match=f"x.json: {message}") as error:
            read_json_object(tmp_path / "x.json")
        assert "\n" not in str(error.value)
    (tmp_path / "x.json").write_text('{"a": 1}')
    assert read_json_object(tmp_path / "x.json") == {"a": 1}


def reaped_pid() -> int:
    """The pid of a process that has ended and been reaped: pids are handed out in turn, so none reuses it soon."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_leftovers_of_dead_processes_of_this_host_are_removed(tmp_path):
    """What a SIGKILL mid-checkpoint leaves: a hidden sibling named after the writer's host and pid. Only a dead
    process's of this host goes; a running one's (another run writing now), another host's, and anything not of
    that form stay."""
    host, dead = socket.gethostname(), reaped_pid()
    names = {"dead": f".step-00000004.tmp-{host}-{dead}-0123abcd",
             "dead-old": f".step-00000004.old-{host}-{dead}-4567cdef",
             "running": f".step-00000006.tmp-{host}-{os.getpid()}-89abcdef",
             "elsewhere": f".step-00000006.deleted-other-{host}-{dead}-0123abcd",
             "other": f".notes.tmp-{dead}-0123abcd", "checkpoint": "step-00000002"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1000)
    removed = remove_leftovers(tmp_path)
    assert sorted(removed) == sorted([(tmp_path / names["dead"], 1000), (tmp_path / names["dead-old"], 1000)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if not k.startswith("dead"))
    assert remove_leftovers(tmp_path / "missing") == []


def test_a_sibling_is_named_after_its_host_and_pid(tmp_path):
    """So that remove_leftovers can tell whose it is."""
    seen = []
    write_dir_atomically(tmp_path / "out", lambda tmp: seen.append(tmp.name), is_ours, "ours")
    assert seen[0].startswith(f".out.tmp-{socket.gethostname()}-{os.getpid()}-")


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_safetensors_files_get_a_new_files_mode_as_the_json_beside_them(tmp_path, mask):
    """REVIEW: checkpoint and HF-export safetensors were mode 0600 (safetensors writes a private temporary file and
    renames it) while the JSON beside them was 0644."""
    previous = os.umask(mask)
    try:
        assert files.umask() == mask
        files.write_safetensors({"w": torch.ones(2)}, tmp_path / "model.safetensors")
        files.write_json(tmp_path / "fastml.json", {})
    finally:
        os.umask(previous)
    modes = {stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("model.safetensors", "fastml.json")}
    assert modes == {0o666 & ~mask}

