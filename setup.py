"""Maps each top-level folder onto the `modelfleet` import namespace (see pyproject.toml for metadata).

`operator/` has no __init__.py at its top: run from the repo root, a namespace portion can never shadow the
standard library's `operator` module, because a regular module found anywhere on sys.path wins over it.
"""

from setuptools import find_namespace_packages, setup

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


setup(
    packages=_packages(),
    package_dir=PARTS,
    package_data={"": ["*.txt", "*.json", "*.yaml", "*.ini", "*.mako", "*.jinja"]},
)
