"""The installed package holds what the product runs: a module that only tests or benchmarks import belongs
under tests/ or bench/ (kernel references and test batches: tests/dataplane/kernels/).

A module counts as the product's when another module of the package imports it (or one of its
submodules), names it (a lazy import, a `python -m` in the Makefile, an entry point in pyproject.toml),
is its package's `__main__`, or Alembic loads it from its script folder.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = dict(re.findall(r'"(modelfleet\.\w+)": "(\w+)"', (ROOT / "setup.py").read_text()))
# Loaded by path from the migration script folder, never imported by name.
ALEMBIC = re.compile(r"^modelfleet\.controlplane\.alembic\.(env|versions\.\w+)$")
# Modules only tests import today, each with why it still ships; the last test keeps this list true.
NOT_MOVED_YET = {
    "modelfleet.operator.crd_checks": "the offline CRD checker; only tests/operator imports it",
}


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PARTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every module name `path` imports, at its top or inside a function, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, node.module] if node.module else base)
            names.add(source)
            names |= {f"{source}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return names


@functools.cache
def modules_only_tests_use() -> frozenset[str]:
    modules = package_modules()
    used: set[str] = set()
    for module, path in modules.items():
        for name in imported_names(module, path) - {module}:
            parts = name.split(".")
            used |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # importing a.b.c imports a.b
    texts = {module: path.read_text() for module, path in modules.items()}
    texts["Makefile"] = (ROOT / "Makefile").read_text()
    texts["pyproject.toml"] = (ROOT / "pyproject.toml").read_text()
    for source, text in texts.items():
        used |= set(re.findall(r"modelfleet(?:\.\w+)+", text)) - {source}
    return frozenset(
        module
        for module in modules
        if module not in used
        and module not in PARTS
        and not module.endswith(".__main__")  # `python -m` of its package
        and not ALEMBIC.match(module)
    )


def test_no_module_of_the_package_serves_only_tests_or_benchmarks():
    unused = modules_only_tests_use() - set(NOT_MOVED_YET)
    assert not unused, f"only tests or benchmarks use {sorted(unused)}: move them under tests/ or bench/"


def test_no_module_of_the_package_imports_tests_or_benchmarks():
    modules = package_modules()
    wrong = sorted(
        f"{module} imports {name}"
        for module, path in modules.items()
        for name in imported_names(module, path)
        if name.partition(".")[0] in {"tests", "bench"}
    )
    assert not wrong, wrong


def test_the_check_finds_a_module_nothing_imports():
    assert set(NOT_MOVED_YET) <= modules_only_tests_use(), "drop the modules the package uses now"
    assert "modelfleet.dataplane.kernels.registry" not in modules_only_tests_use()
