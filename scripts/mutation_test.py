#!/usr/bin/env python3
"""Mutation testing of the modules whose mistakes cost the most: does a test fail when the code is wrong?

For each module in MODULES, small mistakes (mutants) are made one at a time: a comparison flipped
(`<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`, `in` <-> `not in`, `is` <-> `is not`), `and` <-> `or`,
`+` <-> `-`, an integer constant moved by one, `not x` -> `x`, `return True` <-> `return False`,
`min` <-> `max`, a statement replaced by `pass`. Each mutant is written into a private copy of the
repository and the module's tests (the table below) run against it; a mutant is killed when they fail
(or time out). The score of a module is killed / tried; the survivors are printed so that each gets a
test, or a reason why it is equivalent (behaves like the original).

The repository itself is never touched. The copy is `git archive HEAD` (committed code only: others may be
editing the working tree) in a temporary folder; a `sitecustomize.py` on PYTHONPATH puts the copy's
folders in front of the editable install, for the test process and any Python it starts, and the script
checks that the copy's module is the one imported before it starts.

    .venv/bin/python scripts/mutation_test.py                    # every module, at most 20 mutants each
    .venv/bin/python scripts/mutation_test.py checks admission   # some modules (names from MODULES)
    .venv/bin/python scripts/mutation_test.py --max-mutants 0    # every mutant (slow)
    .venv/bin/python scripts/mutation_test.py --list checks      # the mutants, without running anything

Not part of `make test`: one module takes a few minutes.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = {
    "modelfleet.cli": "cli",
    "modelfleet.operator": "operator",
    "modelfleet.controlplane": "controlplane",
    "modelfleet.dataplane": "dataplane",
    "modelfleet.converters": "converters",
}


@dataclass(frozen=True)
class Module:
    path: str  # the source file, from the repository root
    tests: tuple[str, ...]  # the test files that must catch its mutants
    # Only mutate inside these top-level functions, classes ("Class" or "Class.method") or module-level
    # assignments ("NAME"); () = anywhere.
    scope: tuple[str, ...] = ()
    pytest_args: tuple[str, ...] = ()


SERVER = "tests/dataplane/server"
MODULES: dict[str, Module] = {
    # test_speculative.py: the draft slots a decode holds and the verify step's accepted tokens.
    "scheduler": Module(
        "dataplane/engine/scheduler.py",
        ("tests/dataplane/engine/test_scheduler.py", "tests/dataplane/engine/test_speculative.py"),
    ),
    # test_host_kv.py: spills and loads of the host tier; test_speculative.py: rejected drafts trimmed.
    "block_manager": Module(
        "dataplane/engine/block_manager.py",
        (
            "tests/dataplane/engine/test_block_manager.py",
            "tests/dataplane/engine/test_scheduler.py",
            "tests/dataplane/engine/test_host_kv.py",
            "tests/dataplane/engine/test_speculative.py",
        ),
    ),
    "router": Module("dataplane/server/router.py", (f"{SERVER}/test_router.py",)),
    "admission": Module(
        "dataplane/server/admission.py",
        (f"{SERVER}/test_auth.py", f"{SERVER}/test_admission_gates.py", f"{SERVER}/test_batch_admission.py"),
    ),
    "limiter": Module(
        "dataplane/server/auth.py",
        (f"{SERVER}/test_auth.py", f"{SERVER}/test_batch_admission.py", f"{SERVER}/test_dataplane.py"),
        scope=("RateLimiter", "KeyStore.authenticate"),
    ),
    # The facade's per-request steps: route, key limits (the prompt-token charge), checks, admission.
    "dataplane": Module(
        "dataplane/server/dataplane.py",
        (f"{SERVER}/test_dataplane.py", f"{SERVER}/test_batch_admission.py"),
        scope=("DataPlane._start",),
    ),
    "checks": Module(
        "dataplane/server/checks.py", (f"{SERVER}/test_dataplane.py", f"{SERVER}/test_batch_admission.py")
    ),
    "validate": Module(
        "converters/validate.py",
        ("tests/converters/test_validate.py", "tests/converters/test_validate_relative.py"),
        scope=("compare", "perplexity", "THRESHOLDS"),
    ),
    "authz": Module(
        "controlplane/api/deps.py",
        (
            "tests/controlplane/test_controlplane_authz.py",
            "tests/controlplane/test_controlplane_api.py::test_revoked_and_expired_keys_are_refused_and_leave_the_secret",
        ),
        scope=("_authenticate", "require_admin", "get_path_tenant", "get_path_model", "get_path_version"),
        pytest_args=("-m", "not postgres"),
    ),
    "audit": Module(
        "controlplane/api/routes/audit.py",
        ("tests/controlplane/test_controlplane_authz.py",),
        pytest_args=("-m", "not postgres"),
    ),
    # The oracles of the GPU kernel tests, against independent implementations on the CPU.
    "kernel_reference": Module(
        "tests/dataplane/kernels/reference.py", ("tests/dataplane/kernels/test_reference.py",)
    ),
    "rollout": Module("operator/reconcile/rollout.py", ("tests/operator/test_reconcile_rollout.py",)),
}

SWAP_CMP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
SWAP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add}
SWAP_CALL = {"min": "max", "max": "min"}
# Calls whose deletion only changes logs, metrics or spans: not what these tests are for.
QUIET_CALLS = ("log.", "logger.", "logging.", "span.", "bar.", "self.metrics.", "progress.")


@dataclass
class Mutant:
    index: int
    line: int
    operator: str
    before: str
    after: str
    result: str = ""  # killed | survived | timeout
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"line {self.line}: [{self.operator}] {self.before}  ->  {self.after}"


class _Mutator(ast.NodeTransformer):
    """Walks a module in a fixed order and numbers every place it can mutate. With `target` set, it
    changes that one place and records what it did."""

    def __init__(self, scope: tuple[str, ...], target: int | None = None) -> None:
        self.scope = scope
        self.target = target
        self.count = 0
        self.found: list[tuple[int, str, str, str]] = []  # line, operator, before, after
        self._names: list[str] = []

    # -- where we are ------------------------------------------------------------------------------

    def _in_scope(self) -> bool:
        if not self.scope:
            return True
        qual = ".".join(self._names)
        return any(qual == s or qual.startswith(s + ".") for s in self.scope)

    def _visit_named(self, node):
        self._names.append(node.name)
        try:
            # Decorators, defaults and annotations are left alone: only the body is mutated.
            node.body = self._visit_body(node.body)
        finally:
            self._names.pop()
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_named

    def visit_AnnAssign(self, node):
        named = not self._names and isinstance(node.target, ast.Name)
        if named:
            self._names.append(node.target.id)
        try:
            if node.value is not None:
                node.value = self.visit(node.value)
            return self._maybe_delete(node)
        finally:
            if named:
                self._names.pop()

    def visit_JoinedStr(self, node):
        return node  # messages in f-strings are not behaviour

    def _visit_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for i, stmt in enumerate(body):
            if i == 0 and _is_docstring(stmt):
                out.append(stmt)
                continue
            out.append(self.visit(stmt))
        return out

    # -- the mutation sites --------------------------------------------------------------------------

    def _site(self, node: ast.AST, operator: str, make) -> ast.AST:
        """One mutation site: returns the mutated node if it is the target, else the node."""
        if not self._in_scope():
            return node
        index = self.count
        self.count += 1
        if self.target is None:
            mutated = make(copy.deepcopy(node))
            self.found.append((node.lineno, operator, _short(node), _short(mutated)))
            return node
        if index != self.target:
            return node
        before = _short(node)
        mutated = make(node)
        self.found.append((getattr(node, "lineno", 0), operator, before, _short(mutated)))
        return mutated

    def generic_visit(self, node):
        if isinstance(node, ast.stmt):
            for name in ("body", "orelse", "finalbody"):
                if isinstance(getattr(node, name, None), list):
                    setattr(node, name, self._visit_body(getattr(node, name)))
            for name, value in ast.iter_fields(node):
                if name in ("body", "orelse", "finalbody"):
                    continue
                if isinstance(value, list):
                    setattr(node, name, [self.visit(v) if isinstance(v, ast.AST) else v for v in value])
                elif isinstance(value, ast.AST):
                    setattr(node, name, self.visit(value))
            return node
        return super().generic_visit(node)

    def visit_Module(self, node):
        node.body = self._visit_body(node.body)
        return node

    def visit_Compare(self, node):
        node = self.generic_visit(node)
        for k, op in enumerate(node.ops):
            if type(op) in SWAP_CMP:
                new = SWAP_CMP[type(op)]

                def make(n, k=k, new=new):
                    n.ops[k] = new()
                    return n

                node = self._site(node, "compare", make)
        return node

    def visit_BoolOp(self, node):
        node = self.generic_visit(node)

        def make(n):
            n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
            return n

        return self._site(node, "and/or", make)

    def visit_BinOp(self, node):
        node = self.generic_visit(node)
        if type(node.op) in SWAP_BIN:

            def make(n):
                n.op = SWAP_BIN[type(n.op)]()
                return n

            node = self._site(node, "+/-", make)
        return node

    def visit_UnaryOp(self, node):
        node = self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return self._site(node, "not", lambda n: n.operand)
        return node

    def visit_Constant(self, node):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            return node
        if isinstance(value, float) and value == 0.0:
            return node  # 0.0 * 1.1 is 0.0
        if isinstance(value, float):  # a threshold or tolerance loosened or tightened by 10%

            def make(n):
                n.value = value * 1.1
                return n

            return self._site(node, "x1.1", make)

        def make(n):
            n.value = value + 1
            return n

        return self._site(node, "off-by-one", make)

    def visit_Call(self, node):
        node = self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in SWAP_CALL:

            def make(n):
                n.func = ast.Name(SWAP_CALL[n.func.id], ast.Load())
                return n

            node = self._site(node, "min/max", make)
        return node

    def visit_Return(self, node):
        node = self.generic_visit(node)
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, bool):

            def make(n):
                n.value = ast.Constant(not n.value.value)
                return n

            return self._site(node, "return bool", make)
        return self._maybe_delete(node)

    def _maybe_delete(self, node):
        quiet = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        if quiet and _short(node.value).startswith(QUIET_CALLS):
            return node
        return self._site(node, "delete", lambda n: ast.copy_location(ast.Pass(), n))

    def visit_Expr(self, node):
        return self._maybe_delete(self.generic_visit(node))

    def visit_Assign(self, node):
        # A module-level constant (a table of limits) is a scope of its own name.
        named = not self._names and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        if named:
            self._names.append(node.targets[0].id)
        try:
            return self._maybe_delete(self.generic_visit(node))
        finally:
            if named:
                self._names.pop()

    def visit_AugAssign(self, node):
        node = self.generic_visit(node)
        if type(node.op) in SWAP_BIN:

            def make(n):
                n.op = SWAP_BIN[type(n.op)]()
                return n

            node = self._site(node, "+/-", make)
        return self._maybe_delete(node)

    def visit_Raise(self, node):
        return self._maybe_delete(self.generic_visit(node))

    def visit_Break(self, node):
        return self._site(node, "delete", lambda n: ast.copy_location(ast.Pass(), n))

    visit_Continue = visit_Break


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _short(node: ast.AST, width: int = 90) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def enumerate_mutants(source: str, scope: tuple[str, ...]) -> list[Mutant]:
    finder = _Mutator(scope)
    finder.visit(ast.parse(source))
    return [Mutant(i, *site) for i, site in enumerate(finder.found)]


def mutate(source: str, scope: tuple[str, ...], index: int) -> str:
    tree = ast.parse(source)
    mutator = _Mutator(scope, target=index)
    tree = mutator.visit(tree)
    if len(mutator.found) != 1:
        raise RuntimeError(f"mutant {index} not found")
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


DECISIONS = ("compare", "and/or", "not", "return bool", "min/max")


def pick(mutants: list[Mutant], limit: int) -> list[Mutant]:
    """At most `limit` mutants (all of them when limit is 0): the changed decisions (comparisons, and/or,
    not, returned booleans, min/max) first, spread evenly over the file, then the others likewise."""
    if not limit or len(mutants) <= limit:
        return mutants
    decisions = [m for m in mutants if m.operator in DECISIONS]
    others = [m for m in mutants if m.operator not in DECISIONS]
    chosen = _spread(decisions, limit) + _spread(others, max(0, limit - len(decisions)))
    return sorted(chosen, key=lambda m: m.index)


def _spread(items: list[Mutant], limit: int) -> list[Mutant]:
    if limit <= 0:
        return []
    if len(items) <= limit:
        return items
    step = len(items) / limit
    return [items[int(i * step)] for i in range(limit)]


# -- the private copy ---------------------------------------------------------------------------------

SITECUSTOMIZE = '''"""Written by scripts/mutation_test.py: modelfleet from this copy, not the editable one."""
import sys
from importlib.machinery import ModuleSpec, PathFinder
from importlib.util import spec_from_file_location
from pathlib import Path

_ROOT = Path({root!r})
_PARTS = {parts!r}


class _CopyFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "modelfleet":
            spec = ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        if fullname in _PARTS:
            folder = _ROOT / _PARTS[fullname]
            init = folder / "__init__.py"
            if init.exists():
                return spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])
            spec = ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        if fullname.startswith("modelfleet.") and path is not None:
            return PathFinder.find_spec(fullname, path)
        return None


sys.meta_path.insert(0, _CopyFinder)
'''


def make_copy(dest: Path) -> None:
    """The committed tree (HEAD) in `dest`, plus the import shim."""
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    shim = dest / ".mutation"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=str(dest), parts=PARTS))


def copy_env(dest: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(dest / ".mutation"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a stale .pyc must never stand in for a mutant
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_copy_is_imported(dest: Path, env: dict[str, str], module: Module) -> None:
    name = module.path.removesuffix(".py").replace("/", ".")
    if not name.startswith("tests."):  # test helpers import as tests.*, from the copy's root
        name = "modelfleet." + name
    for part, folder in PARTS.items():
        if name.startswith(f"modelfleet.{folder}."):
            name = part + name.removeprefix(f"modelfleet.{folder}")
    probe = f"import importlib; print(importlib.import_module({name!r}).__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=dest, env=env, capture_output=True, text=True)
    where = Path(out.stdout.strip() or "?")
    if where != dest / module.path:
        raise SystemExit(f"the copy is not what gets imported: {name} came from {where}\n{out.stderr}")


def run_tests(dest: Path, env: dict[str, str], module: Module, timeout: int) -> tuple[str, list[str]]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--timeout={timeout}",
        *module.pytest_args,
        *module.tests,
    ]
    try:
        proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout * 3)
    except subprocess.TimeoutExpired:
        return "timeout", []
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    return ("passed" if proc.returncode == 0 else "failed"), tail


# -- main ---------------------------------------------------------------------------------------------


def run_module(name: str, module: Module, dest: Path, env: dict[str, str], args) -> list[Mutant]:
    target = dest / module.path
    original = target.read_text()
    every = enumerate_mutants(original, module.scope)
    total = len(every)
    if args.replace:
        old, new = args.replace
        if original.count(old) != 1:
            raise SystemExit(f"--replace: {old!r} occurs {original.count(old)} times in {module.path}")
        every = [Mutant(-1, original[: original.index(old)].count("\n") + 1, "by hand", old, new)]
        mutants = every
    elif args.only:
        mutants = [m for m in every if m.index in args.only]
    else:
        mutants = pick(every, args.max_mutants)
    print(f"\n== {name}: {module.path} ({len(mutants)} of {total} mutants; tests: {' '.join(module.tests)})")
    check_copy_is_imported(dest, env, module)
    started = time.monotonic()
    status, tail = run_tests(dest, env, module, args.timeout)
    if status != "passed":
        print("   the tests fail without a mutant; skipping the module\n   " + "\n   ".join(tail))
        return []
    print(f"   baseline passes in {time.monotonic() - started:.1f}s")
    try:
        for m in mutants:
            if m.index < 0:
                target.write_text(original.replace(m.before, m.after))
            else:
                target.write_text(mutate(original, module.scope, m.index))
            started = time.monotonic()
            status, m.tail = run_tests(dest, env, module, args.timeout)
            m.seconds = time.monotonic() - started
            m.result = {"passed": "survived", "failed": "killed"}.get(status, status)
            mark = "SURVIVED" if m.result == "survived" else m.result
            print(f"   {mark:8} {m.seconds:5.1f}s  {m.describe()}", flush=True)
            if m.index < 0 or args.verbose:
                print("      " + "\n      ".join(m.tail))
    finally:
        target.write_text(original)
    return mutants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"some of: {', '.join(MODULES)} (default: all)")
    parser.add_argument(
        "--max-mutants", type=int, default=20, help="per module, spread over the file; 0 = all"
    )
    parser.add_argument("--timeout", type=int, default=60, help="per test (pytest-timeout), seconds")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument(
        "--tests", nargs="+", help="run these tests (paths or node ids) instead of the table's"
    )
    parser.add_argument("--only", type=int, nargs="+", help="run these mutants (numbers from --list)")
    parser.add_argument(
        "--replace", nargs=2, metavar=("OLD", "NEW"), help="one mutant by hand: OLD (once in the file) -> NEW"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show how each mutant's tests ended")
    parser.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; known: {', '.join(MODULES)}")
    chosen = args.modules or list(MODULES)
    if (args.only or args.replace) and len(chosen) != 1:
        parser.error("--only and --replace need exactly one module")

    if args.list:
        for name in chosen:
            module = MODULES[name]
            mutants = enumerate_mutants((REPO / module.path).read_text(), module.scope)
            picked = {m.index for m in pick(mutants, args.max_mutants)}
            print(f"== {name}: {module.path} ({len(mutants)} mutants, * = run by default)")
            for m in mutants:
                print(f"  {'*' if m.index in picked else ' '} {m.index:3} {m.describe()}")
        return 0

    dest = Path(tempfile.mkdtemp(prefix="modelfleet-mutation-"))
    results: dict[str, list[Mutant]] = {}
    try:
        make_copy(dest)
        env = copy_env(dest)
        print(f"copy of HEAD in {dest}")
        for name in chosen:
            module = MODULES[name]
            if args.tests:
                module = dataclasses.replace(module, tests=tuple(args.tests))
            results[name] = run_module(name, module, dest, env, args)
    finally:
        if args.keep:
            print(f"kept {dest}")
        else:
            shutil.rmtree(dest, ignore_errors=True)

    print("\n== score (killed / tried)")
    survivors = []
    for name, mutants in results.items():
        killed = sum(m.result in ("killed", "timeout") for m in mutants)
        score = f"{100 * killed / len(mutants):5.1f}%" if mutants else "  n/a"
        print(f"   {name:14} {killed:3} / {len(mutants):3}  {score}")
        survivors += [(name, m) for m in mutants if m.result == "survived"]
    if survivors:
        print("\n== surviving mutants")
        for name, m in survivors:
            print(f"   {name}: {m.describe()}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
