"""What `pip install modelfleet` brings, and what the extras add.

The base package is the data plane and the converter (`modelfleet serve`, `modelfleet convert`, the image
GPU pods run); the operator's and the control plane's libraries are extras. The slow tests install the
base package alone into a fresh venv and run the commands there.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
from modelfleet.cli.commands import EXTRAS, SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TORCH_PIN = re.search(r"^TORCH_VERSION := ([\w.]+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
# Where wheels of the base dependencies are kept between runs (of any checkout: the user's cache, as pip's
# own), one folder per set of versions.
WHEELHOUSE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modelfleet" / "wheelhouse"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0))


def extra_modules() -> set[str]:
    return {module for modules in EXTRAS.values() for module in modules}


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def test_torch_is_a_floor_so_an_installed_cuda_build_stays():
    (torch,) = [r for r in PROJECT["dependencies"] if requirement_name(r) == "torch"]
    floor = re.fullmatch(r"torch\s*>=\s*([\d.]+)", torch)
    assert floor, f"{torch!r}: ask for a floor (torch>=X); the exact pin belongs to the Makefile"
    assert version_tuple(floor.group(1)) >= (2, 6)
    assert version_tuple(TORCH_PIN) >= version_tuple(floor.group(1)), "the Makefile's pin is below the floor"


def test_the_base_package_leaves_the_operator_and_control_plane_libraries_out():
    base = {requirement_name(r) for r in PROJECT["dependencies"]}
    for module in extra_modules():
        for dist in importlib.metadata.packages_distributions().get(module, [module]):
            assert canonical(dist) not in base, f"{dist} is a base dependency; it belongs to an extra"


@pytest.mark.parametrize("extra", sorted(set(PROJECT["optional-dependencies"]) - {"dev"}))
def test_the_cli_knows_each_extra_by_the_modules_it_installs(extra):
    """EXTRAS (cli/commands.py) names the modules that tell an extra is installed: the same set of
    distributions as the extra's requirements, so the CLI cannot send a user to install the wrong one."""
    assert extra in EXTRAS, f"add the {extra!r} extra's modules to EXTRAS in cli/commands.py"
    installed = importlib.metadata.packages_distributions()
    provided = {canonical(dist) for module in EXTRAS[extra] for dist in installed.get(module, [])}
    required = {requirement_name(r) for r in PROJECT["optional-dependencies"][extra]}
    assert provided == required, f"EXTRAS[{extra!r}] installs {provided}; pyproject.toml's extra: {required}"


def test_every_extra_a_subcommand_needs_is_declared():
    declared = set(PROJECT["optional-dependencies"])
    for name, command in SUBCOMMANDS.items():
        assert set(command.extras) <= declared, f"{name} needs {command.extras}: declare them in pyproject"
    assert set(EXTRAS) <= declared


def test_dev_installs_every_extra():
    (itself,) = [r for r in PROJECT["optional-dependencies"]["dev"] if requirement_name(r) == "modelfleet"]
    included = set(re.search(r"\[([\w,-]+)\]", itself).group(1).split(","))
    assert included == set(PROJECT["optional-dependencies"]) - {"dev"}


@pytest.mark.parametrize("folder", ["dataplane", "converters"])
def test_the_data_plane_and_converters_never_import_an_extra(folder):
    """Not even inside a function: what `modelfleet serve` and `convert` run must need the base only."""
    forbidden = extra_modules()
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.partition(".")[0] not in forbidden, f"{path}:{node.lineno} imports {name}"


# --- The base package alone, in a fresh venv -------------------------------------------------------------


def run(*command: str | Path, timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )


def checked(*command: str | Path, timeout: int = 600) -> subprocess.CompletedProcess:
    result = run(*command, timeout=timeout)
    assert result.returncode == 0, f"{command}: {result.stdout[-2000:]}{result.stderr[-4000:]}"
    return result


def build_wheel(work: Path) -> Path:
    """The project's wheel, built from a copy of the sources (a build in the checkout would race others)."""
    source = work / "source"
    source.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in re.findall(r'"modelfleet\.\w+": "(\w+)"', (ROOT / "setup.py").read_text()):
        shutil.copytree(ROOT / folder, source / folder, ignore=skip)
    checked(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work, source
    )
    (wheel,) = work.glob("modelfleet-*.whl")
    return wheel


def base_wheelhouse(constraints: Path) -> Path:
    """Wheels of the base dependencies but torch, downloaded once per set of versions and kept in the
    user's cache: later runs, of this checkout or a fresh clone, install them without the network."""
    requirements = sorted(r for r in PROJECT["dependencies"] if requirement_name(r) != "torch")
    key = hashlib.sha256(
        json.dumps([sys.version, platform.platform(), requirements, constraints.read_text()]).encode()
    ).hexdigest()[:16]
    house = WHEELHOUSE / key
    if not house.is_dir():
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        partial = WHEELHOUSE / f".{key}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        checked(
            sys.executable, "-m", "pip", "download", "-q", "-d", partial, "-c", constraints, *requirements
        )
        try:
            partial.rename(house)  # atomic: a concurrent run's finished download wins
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
        # Each change of versions makes a new one (~100 MB): drop those unused for a day.
        for old in WHEELHOUSE.iterdir():
            if old != house and time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
    os.utime(house)
    return house


def environment_pins(work: Path) -> Path:
    """The versions of this environment (what the rest of the suite tested) as pip constraints."""
    pins = {
        canonical(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"] and canonical(dist.metadata["Name"]) not in {"modelfleet", "torch"}
    }
    path = work / "constraints.txt"
    path.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    return path


class BaseInstall(NamedTuple):
    venv: Path
    wheel: Path
    wheelhouse: Path


@pytest.fixture(scope="module")
def base_install(tmp_path_factory) -> BaseInstall:
    """A fresh venv: torch at the Makefile's pin first (as a CUDA image or `make setup` would have it),
    then the base package from its wheel, no extra."""
    work = tmp_path_factory.mktemp("base-venv")
    wheel = build_wheel(work)
    venv = work / "venv"
    python = venv / "bin" / "python"
    with ThreadPoolExecutor(max_workers=1) as pool:
        # A first run's download (network) goes on while torch installs (disk).
        house = pool.submit(base_wheelhouse, environment_pins(work))
        checked(sys.executable, "-m", "venv", venv)
        checked(python, "-m", "pip", "install", "-q", "--no-compile", f"torch=={TORCH_PIN}")
        house = house.result()
    checked(
        python, "-m", "pip", "install", "-q", "--no-compile", "--no-index", "--find-links", house,
        "-c", work / "constraints.txt", wheel,
    )  # fmt: skip
    return BaseInstall(venv, wheel, house)


@pytest.fixture(scope="module")
def base_venv(base_install) -> Path:
    return base_install.venv


OPTIONAL_TOOLS = {
    "triton": "comes with the CUDA builds of torch; the GPU kernels need it",
    "tensorrt": "TensorRT engines only; a missing one is the converter's exit 3",
    "grpc_tools": "compiles the gRPC .proto in a source checkout; a wheel carries it compiled",
}

# Run in the base venv: what is installed and what imports, in one process (torch is imported once).
PROBE = """
import importlib, importlib.metadata, importlib.util, json, pkgutil, sys
import modelfleet.converters, modelfleet.dataplane

extras, third_party = json.loads(sys.argv[1])
broken = {}
for package in (modelfleet.dataplane, modelfleet.converters):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            broken[info.name] = exc.name
print(json.dumps({
    "torch": importlib.metadata.version("torch"),
    "extras_found": [m for m in extras if importlib.util.find_spec(m) is not None],
    "third_party_missing": [m for m in third_party if importlib.util.find_spec(m) is None],
    "modules_broken": broken,
}))
"""


def third_party_imports(*folders: str) -> set[str]:
    """Every top-level module the sources of `folders` import, at their top or inside a function."""
    found = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {alias.name.partition(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.partition(".")[0])
    return found - set(sys.stdlib_module_names) - {"modelfleet", "__future__"}


@pytest.fixture(scope="module")
def probe(base_venv) -> dict:
    wanted = [sorted(extra_modules()), sorted(third_party_imports("dataplane", "converters", "cli"))]
    result = checked(base_venv / "bin" / "python", "-c", PROBE, json.dumps(wanted))
    return json.loads(result.stdout.strip().splitlines()[-1])


# About a minute with the wheelhouse filled; the first run downloads it.
@pytest.mark.slow
@pytest.mark.timeout(1200)
class TestTheBasePackageAlone:
    def test_installing_the_package_keeps_the_installed_torch(self, probe):
        assert probe["torch"].split("+")[0] == TORCH_PIN

    def test_no_library_of_an_extra_is_installed(self, probe):
        assert {"kopf", "sqlalchemy", "kubernetes", "alembic"} <= extra_modules()
        assert probe["extras_found"] == []

    def test_everything_the_data_plane_and_converters_import_is_installed(self, probe):
        """Lazy imports included (transformers, onnxruntime, ...): found, not imported."""
        assert set(probe["third_party_missing"]) <= set(OPTIONAL_TOOLS), probe["third_party_missing"]

    def test_every_data_plane_and_converter_module_imports(self, probe):
        broken = probe["modules_broken"]
        assert set(broken.values()) <= {"triton"}, broken
        assert all(name.startswith("modelfleet.dataplane.kernels.") for name in broken), broken

    @pytest.mark.parametrize(("command", "option"), [("serve", "--manifest"), ("convert", "--target")])
    def test_serve_and_convert_start(self, base_venv, command, option):
        result = checked(base_venv / "bin" / "modelfleet", command, "--help")
        assert option in result.stdout

    @pytest.mark.parametrize("command", ["operator", "controlplane"])
    def test_a_command_of_a_missing_extra_says_which_extra(self, base_venv, command):
        result = run(base_venv / "bin" / "modelfleet", command, timeout=60)
        assert result.returncode == 2
        assert result.stderr.splitlines() == [
            f"modelfleet {command}: error: needs the '{command}' extra: pip install 'modelfleet[{command}]'"
        ]
        assert result.stdout == ""

    def test_an_installed_cuda_build_of_torch_is_kept(self, base_install, tmp_path):
        """pip resolves the package for an environment holding torch 2.6.0+cu124 (its metadata only):
        nothing replaces it, as an exact pin in the package's metadata would."""
        env = tmp_path / "cuda-env"
        checked(sys.executable, "-m", "venv", "--without-pip", env)
        purelib = checked(
            env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        )
        dist_info = Path(purelib.stdout.strip()) / "torch-2.6.0+cu124.dist-info"
        dist_info.mkdir(parents=True)
        (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.6.0+cu124\n")
        (dist_info / "INSTALLER").write_text("pip\n")
        (dist_info / "RECORD").write_text("")
        report = tmp_path / "report.json"
        checked(
            base_install.venv / "bin" / "python", "-m", "pip", "--python", env / "bin" / "python",
            "install", "--dry-run", "-q", "--no-index", "--find-links", base_install.wheelhouse,
            "--report", report, base_install.wheel,
        )  # fmt: skip
        installs = {canonical(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}
        assert "modelfleet" in installs
        assert "torch" not in installs

    def test_crds_need_no_extra(self, base_venv, tmp_path):
        checked(base_venv / "bin" / "modelfleet", "crds", "--out", tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "inferencemodels.modelfleet.dev.yaml",
            "modelversions.modelfleet.dev.yaml",
        ]
