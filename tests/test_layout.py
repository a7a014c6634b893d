"""The one dependency rule (DESIGN.md): the planner and the executor import the contract in fastml/, never each
other; the executor never imports optuna; measuring a machine lives with the profiles it writes (hwprofiles/),
which may use the executor's ops, while the planner only reads profiles."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder, forbidden", [("planner", ("fastml.executor", "torch")),
                                               ("executor", ("fastml.planner", "optuna")),
                                               ("hwprofiles", ("fastml.planner",)),
                                               ("fastml", ("fastml.executor.", "fastml.planner."))])
def test_each_part_imports_only_what_the_rule_allows(folder, forbidden):
    offending = {f"{path.relative_to(ROOT)}: {module}" for path in sources(folder) for module in imported_modules(path)
                 if any(module == f.rstrip(".") or module.startswith(f.rstrip(".") + ".") for f in forbidden)
                 and not (folder == "fastml" and path.name == "cli.py")}
    assert not offending, sorted(offending)


def test_the_executor_is_grouped_by_part():
    """No module sits loose at the executor's top but the package's entry and the native-op loader."""
    loose = sorted(p.name for p in (ROOT / "executor").glob("*.py"))
    assert loose == ["__init__.py", "native.py"]
