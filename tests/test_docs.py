"""The README and docs/ tell the truth about what was measured: every figure they quote is rendered from the results
file that holds it (benchmarks/figures.py), and every file they point to exists."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_figures():
    """benchmarks/figures.py as a module, without putting benchmarks/ on sys.path: there benchmarks/kernels.py would
    hide the `kernels` package that transformers imports when it is installed (transformers 5.25 installs it)."""
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _load_figures()


@pytest.mark.parametrize("path", figures.documents(), ids=lambda p: p.name)
def test_every_quoted_figure_is_its_results_files(path):
    assert figures.problems(path, {}) == []


def test_a_figure_that_differs_from_its_results_file_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("fastml: <!--fig fidelity.json spearman .3f-->0.999<!--/fig-->; HF 8,000 tokens/s\n")  # 0.999: not what was measured
    found = figures.problems(page, {})
    assert len(found) == 2
    measured = json.loads((figures.RESULTS / "fidelity.json").read_text())["spearman"]
    assert f"fidelity.json spearman is {measured:.3f}, the text says 0.999" in found[0]
    assert "'8,000 tokens/s' is quoted without its results file" in found[1]


@pytest.mark.parametrize("path", figures.documents(), ids=lambda p: p.name)
def test_the_links_lead_to_files_that_exist(path):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    missing = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert missing == []
