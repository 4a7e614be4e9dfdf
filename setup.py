"""Maps each top-level folder onto the `modelfleet` import namespace (see pyproject.toml for metadata).

`operator/` has no __init__.py at its top: run from the repo root, a namespace portion can never shadow the
standard library's `operator` module, because a regular module found anywhere on sys.path wins over it.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

PROTO = Path("dataplane/server/grpc/modelfleet.proto")

PARTS = {
    "modelfleet.cli": "cli",
    "modelfleet.operator": "operator",
    "modelfleet.controlplane": "controlplane",
    "modelfleet.dataplane": "dataplane",
    "modelfleet.converters": "converters",
    "modelfleet.local": "local",
}


def _packages() -> list[str]:
    names = []
    for name, folder in PARTS.items():
        names.append(name)
        found = find_namespace_packages(folder, exclude=["*__pycache__*"])
        names += [f"{name}.{sub}" for sub in found if not sub.startswith("__pycache__")]
    return names


class BuildPyWithProto(build_py):
    """Compiles the gRPC .proto into the built package (a wheel). An editable install skips it: the data
    plane compiles the .proto on first use into a cache folder (dataplane/server/grpc/proto.py)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        from grpc_tools import protoc  # a build requirement (pyproject.toml)

        out = Path(self.build_lib, "modelfleet", "dataplane", "server", "grpc")
        include = Path(protoc.__file__).parent / "_proto"
        argv = ["protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={out}", PROTO.name]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")


setup(
    cmdclass={"build_py": BuildPyWithProto},
    packages=_packages(),
    package_dir=PARTS,
    package_data={"": ["*.txt", "*.json", "*.yaml", "*.ini", "*.mako", "*.jinja", "*.proto"]},
)
