"""The message classes of modelfleet.proto.

A wheel carries `modelfleet_pb2.py`, compiled by setup.py's build step. A source checkout or an editable
install has only the .proto: it is compiled on first use into a cache folder keyed by the file's digest,
so an edited .proto is never served stale.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PROTO = Path(__file__).with_name("modelfleet.proto")
PACKAGE = "modelfleet.dataplane.server.grpc"
MODULE = f"{PACKAGE}.modelfleet_pb2"


class ProtoUnavailable(RuntimeError):
    """Neither a compiled module nor the compiler is there."""


def compile_proto(out_dir: Path) -> Path:
    """Compile the .proto into `out_dir/modelfleet_pb2.py` with grpcio-tools (setup.py does the same)."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise ProtoUnavailable(
            f"{PROTO.name} is not compiled and grpcio-tools is not installed: "
            "pip install grpcio-tools, or install modelfleet from a wheel"
        ) from None
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    argv = ["protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={out_dir}", PROTO.name]
    if protoc.main(argv) != 0:
        raise ProtoUnavailable(f"protoc failed on {PROTO}")
    return out_dir / "modelfleet_pb2.py"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modelfleet" / "grpc"


def compiled_path() -> Path:
    """Where this .proto's compiled module lives in the cache (compiling it there if it is not yet)."""
    digest = hashlib.sha256(PROTO.read_bytes()).hexdigest()[:16]
    folder = cache_dir() / digest
    target = folder / "modelfleet_pb2.py"
    if not target.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))
        try:
            compile_proto(staging)
            try:
                staging.rename(folder)  # atomic: a concurrent process sees all of it or nothing
            except OSError:
                if not target.exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def load() -> ModuleType:
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    try:
        return importlib.import_module(MODULE)
    except ModuleNotFoundError:
        pass
    spec = importlib.util.spec_from_file_location(MODULE, compiled_path())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    return module
