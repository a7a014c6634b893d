"""Validated, read-only config trees: frozen kw-only dataclasses built from JSON-like dicts.

Every dataclass of the contract is loaded through `from_dict`, which rejects unknown keys and values of the
wrong type with a `UserError` that names the field (as a dotted path) and what is allowed there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union


class UserError(ValueError):
    """A mistake in what the user gave us: the CLI prints its message as one line and exits with code 2."""


def fail(where: str, message: str) -> typing.NoReturn:
    raise UserError(f"{where}: {message}" if where else message)


def say_on_stderr(line: str) -> None:
    """`line` on stderr, on a line of its own: a worker of a job but rank 0 (its launcher set RANK) writing to a
    terminal starts it after a line break, since rank 0 may be drawing its progress line there, or have died drawing
    it, and the message would end that line."""
    import sys

    from rich.console import Console

    fresh = os.environ.get("RANK", "0") != "0" and Console(stderr=True).is_terminal
    print("\n" * fresh + line, file=sys.stderr, flush=True)


def check_choice(where: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        fail(where, f"{show(value)} is not allowed; choose one of {', '.join(map(repr, allowed))}")


def check_range(where: str, value: float, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False) -> None:
    """`value` in [low, high]; `low_open`/`high_open` leave the bound itself out."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        bounds = (f"{'(' if low_open or low is None else '['}{'-inf' if low is None else low}, "
                  f"{'inf' if high is None else high}{')' if high_open or high is None else ']'}")
        fail(where, f"{show(value)} is outside the allowed range {bounds}")


def show(value: Any, max_chars: int = 60) -> str:
    """`repr(value)`, cut short: an error message stays one readable line whatever the user's file holds."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (sys.get_int_max_str_digits)
        return "a number too large to print"
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def plural(count: int, noun: str) -> str:
    """"1 step", "2 steps", "1,000 steps": a count and its noun (a regular plural)."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


GIB = 2**30


def gib(num_bytes: float | None, digits: int = 1) -> str:
    """Bytes for people: "12.3 GiB"; None (nothing measured) as "n/a"."""
    return "n/a" if num_bytes is None else f"{num_bytes / GIB:.{digits}f} GiB"


def read_json(path: str | Path, what: str, max_bytes: int = 2**24) -> Any:
    """The JSON value in a user's file, which should be `what` ("a plan"): an unreadable, oversized, non-UTF-8,
    malformed or too deeply nested file is a one-line UserError naming the file."""
    if Path(path).exists() and not Path(path).is_file():  # a FIFO or a device would block or never end
        fail(str(path), f"is not a regular file, so not {what}")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)  # bounded: a mistaken path may name gigabytes
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        fail(str(path), f"cannot read {what} from it ({getattr(e, 'strerror', None) or first_line(e)})")
    if len(raw) > max_bytes:
        fail(str(path), f"is over {max_bytes:,} bytes, too large to be {what}")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        fail(str(path), f"is not UTF-8 text (byte {e.start} cannot be decoded), so not {what}")
    except json.JSONDecodeError as e:
        fail(str(path), f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})")
    except RecursionError:
        fail(str(path), f"not {what}: its JSON is nested too deeply to read")
    except ValueError as e:  # an integer literal longer than Python converts
        fail(str(path), f"not {what} ({first_line(e)})")


def check_output_dir(where: str, path: str | Path) -> None:
    """A directory that a long job will write into can be: it is one, or can be made (checked before the work)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        fail(where, f"{path} exists and is not a directory")
    _check_writable(where, path)


def check_output_file(where: str, path: str | Path) -> None:
    """A file that a long job will write after its work can be (checked before the work, which would otherwise be
    lost when the write fails at its end): not a directory, in a directory that exists, and one that opens for
    writing (tried: permissions alone do not tell, root may write anywhere but a read-only or virtual file system)."""
    path = Path(path).expanduser()
    if path.is_dir():
        fail(where, f"{path} is a directory, not a file")
    if not path.parent.is_dir():
        fail(where, f"{path}: the directory {path.parent} does not exist")
    existed = path.exists()
    try:
        with open(path, "a" if existed else "x"):  # appends nothing to a file that exists
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        fail(where, f"{path}: cannot write it ({e.strerror or e})")


def _check_writable(where: str, path: Path) -> None:
    existing = next(p for p in (path, *path.parents) if p.exists())  # what exists of the path, from the end
    if not existing.is_dir() and existing != path:
        fail(where, f"{path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        fail(where, f"{path}: {existing} is not writable")


def first_line(error: BaseException) -> str:
    """The first line of an error's message that says something, or its type's name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Builds dataclass `cls` from `data`, checking every key and every value's type."""
    if not isinstance(data, dict):
        fail(where, f"expected an object with keys {', '.join(field_names(cls))}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [name for name in data if name not in fields]
    if unknown:
        fail(join(where, unknown[0]), f"unknown key; allowed keys are {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        values[name] = _convert(hints[name], value, join(where, name))
    missing = [f.name for f in fields.values() if f.name not in values and _has_no_default(f)]
    if missing:
        fail(join(where, missing[0]), "missing required key")
    return cls(**values)


def as_type(hint: Any, value: Any, where: str) -> Any:
    """`value` checked (and converted, 2.0 to 2 for an int) as `hint`, the way `from_dict` checks a field."""
    return _convert(hint, value, where)


def to_dict(obj: Any) -> Any:
    """The JSON-ready form of a config tree (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def join(where: str, name: Any) -> str:
    """The dotted path of a field; a key that is not a plain name (a user's typo may hold anything) is quoted."""
    if not (isinstance(name, str) and name.isidentifier() and len(name) <= 60):
        return f"{where}[{show(name)}]"
    return f"{where}.{name}" if where else name


def _has_no_default(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            fail(where, "must not be null")
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0] if len(inner) == 1 else _by_json_kind(inner, value, where), value, where)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin is Literal:
        check_choice(where, value, args)
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            fail(where, f"expected a list, got {type(value).__name__}")
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            fail(where, f"expected an object, got {type(value).__name__}")
        return {str(k): _convert(args[1], v, join(where, k)) for k, v in value.items()}
    return _scalar(hint, value, where)


def _by_json_kind(hints: list, value: Any, where: str) -> Any:
    """Of a union's types, the one `value`'s JSON kind stands for: a string, a list or an object."""
    for hint in hints:
        origin = typing.get_origin(hint)
        if (hint is str and isinstance(value, str)) or (origin is tuple and isinstance(value, (list, tuple))) or \
                ((dataclasses.is_dataclass(hint) or origin is dict) and isinstance(value, dict)):
            return hint
    kinds = " or ".join("a string" if h is str else "a list" if typing.get_origin(h) is tuple else "an object"
                        for h in hints)
    fail(where, f"expected {kinds}, got {type(value).__name__}")


def _scalar(hint: type, value: Any, where: str) -> Any:
    # bool is a subclass of int in Python: keep true/false out of numeric fields and numbers out of bool fields.
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int beyond float's range
                number = float("inf")
            if not math.isfinite(number):
                fail(where, f"must be a finite number, got {show(value)}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {hint!r} at {where}")
    fail(where, f"expected {hint.__name__}, got {show(value)}")
