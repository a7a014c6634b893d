"""Renders the measured figures that README.md and docs/*.md quote from the results files that hold them, so that no
figure is typed by hand or outlives its measurement.

A figure is written in the Markdown as

    <!--fig FILE PATH FORMAT-->12,328<!--/fig-->

FILE a file of benchmarks/results/, PATH where the number is in it (keys separated by dots, `[llama-3.1-8b]` a key
that holds dots, `[3]` a list index, `[name=capped]` the list element whose `name` is `capped`), FORMAT a Python format spec (`,.0f`, `.1%`, `.2f`; `GiB.1f`
writes bytes in GiB, `ms.2f` seconds in milliseconds). The
text between the markers is what the renderer writes; the comments do not show on a rendered page.

    python benchmarks/figures.py            # rewrites the figures of README.md and docs/*.md from the results
    python benchmarks/figures.py --check    # says which figures differ from their results, or do not resolve (exit 1)

tests/test_docs.py runs the check, and fails on a figure quoted without markers (a throughput, a speed-up or an MFU).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKED = re.compile(r"<!--fig (?P<file>\S+) (?P<path>\S+) (?P<format>\S+?)-->(?P<text>.*?)<!--/fig-->")
# A measured figure a reader would take for one: tokens/s, a speed-up (1.39x), an MFU.
UNMARKED_FIGURE = re.compile(r"\b\d[\d,]*(\.\d+)?\s*(tokens/s|tok/s)|\b\d+\.\d+\s?[x×](?![\w-])|\b\d+(\.\d+)?%\s*MFU")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def value_at(data, path: str):
    """The value at a PATH of the module's docstring."""
    for part in re.findall(r"[^.\[\]]+|\[[^\]]*\]", path):
        if part.startswith("["):
            inner = part[1:-1]
            if "=" in inner:
                key, _, wanted = inner.partition("=")
                data = next(item for item in data if str(item.get(key)) == wanted)
            else:
                data = data[inner] if isinstance(data, dict) else data[int(inner)]
        else:
            data = data[part]
    return data


def render(match: re.Match, results: dict[str, dict]) -> str:
    """The marked figure written anew from its results file."""
    file = match["file"]
    if file not in results:
        results[file] = json.loads((RESULTS / file).read_text())
    value, spec = value_at(results[file], match["path"]), match["format"]
    if spec.startswith("GiB"):  # bytes, written in GiB
        value, spec = value / 2**30, spec.removeprefix("GiB")
    if spec.startswith("ms"):  # seconds, written in milliseconds
        value, spec = value * 1000, spec.removeprefix("ms")
    text = format(value, spec)
    return f"<!--fig {file} {match['path']} {match['format']}-->{text}<!--/fig-->"


def rendered(text: str, results: dict[str, dict]) -> str:
    return MARKED.sub(lambda m: render(m, results), text)


def problems(path: Path, results: dict[str, dict]) -> list[str]:
    """What is wrong with the figures of one document: stale or unresolvable markers, and figures without markers
    (outside code, which shows commands and output)."""
    found, text = [], path.read_text()
    for match in MARKED.finditer(text):
        try:
            fresh = MARKED.match(render(match, results))["text"]
        except (OSError, KeyError, IndexError, StopIteration, ValueError, TypeError) as e:
            found.append(f"{path.name}: {match[0]}: does not resolve ({type(e).__name__}: {e})")
            continue
        if fresh != match["text"]:
            found.append(f"{path.name}: {match['file']} {match['path']} is {fresh}, the text says {match['text']}")
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", MARKED.sub("", text), flags=re.S)
    for line in prose.splitlines():
        for figure in UNMARKED_FIGURE.finditer(line):
            found.append(f"{path.name}: {figure[0]!r} is quoted without its results file: {line.strip()[:120]}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say what differs; exit 1 if anything does")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    if args.check:
        found = [problem for path in documents() for problem in problems(path, results)]
        print("\n".join(found) or "every figure is its results file's")
        return 1 if found else 0
    for path in documents():
        text = path.read_text()
        if (new := rendered(text, results)) != text:
            path.write_text(new)
            print(f"rewrote the figures of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
