"""The gRPC .proto is compiled, never checked in: the wheel's build step and the source checkout's cache
must produce the same module, and the service must serve every RPC the .proto declares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from modelfleet.dataplane.server.grpc import proto
from modelfleet.dataplane.server.grpc.service import SERVICE

ROOT = Path(__file__).resolve().parents[3]


def test_the_cached_module_matches_a_fresh_compile(tmp_path):
    fresh = proto.compile_proto(tmp_path)
    assert fresh.read_text() == proto.compiled_path().read_text()


def test_the_build_step_compiles_the_proto_into_the_package(tmp_path):
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    built = tmp_path / "modelfleet" / "dataplane" / "server" / "grpc"
    assert (built / "modelfleet.proto").exists()
    assert (built / "modelfleet_pb2.py").read_text() == proto.compiled_path().read_text()


def test_an_edited_proto_gets_its_own_cache_entry(tmp_path, monkeypatch):
    edited = tmp_path / "modelfleet.proto"
    edited.write_text(proto.PROTO.read_text() + "\nmessage Extra {}\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(proto, "PROTO", edited)
    path = proto.compiled_path()
    assert path.is_relative_to(tmp_path / "cache") and "_EXTRA" in path.read_text()


def test_the_service_declares_the_three_rpcs():
    service = proto.load().DESCRIPTOR.services_by_name["Inference"]
    assert service.full_name == SERVICE
    methods = {m.name: m.server_streaming for m in service.methods}
    assert methods == {"Generate": True, "Completion": False, "Chat": False}


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "grpc_tools", None)
    with pytest.raises(proto.ProtoUnavailable, match="pip install grpcio-tools"):
        proto.compile_proto(tmp_path)
