"""hf://ORG/NAME[@REVISION] sources through `huggingface_hub`, against a small Hub served on 127.0.0.1
(HF_ENDPOINT points at it): revisions resolved to commits, only the files a conversion reads fetched,
private repositories with HF_TOKEN, and every failure one line with the right exit code."""

from __future__ import annotations

import json

import huggingface_hub.constants
import pytest
from modelfleet.converters import hub, sources
from modelfleet.converters.convert import Request, convert
from modelfleet.converters.errors import BadInputError

from tests.converters.fake_hub import FakeHub, Repo

COMMIT, OLD = "c" * 40, "0" * 40


@pytest.fixture
def fake_hub(monkeypatch, tiny_model_dir):
    server = FakeHub().start()
    model = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir()}
    extra = {
        "pytorch_model.bin": b"pickle",
        "README.md": b"# card",
        "onnx/model.safetensors": b"other export",
    }
    server.repos["org/tiny"] = Repo({**model, **extra}, refs={"main": COMMIT, "v1": COMMIT})
    server.repos["org/private"] = Repo(model, refs={"main": COMMIT}, token="hf_secret")
    server.repos["org/card-only"] = Repo({"README.md": b"# no model here"}, refs={"main": OLD})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("MODELFLEET_SOURCE_ALLOW_HOSTS", "127.0.0.1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # The suite keeps huggingface_hub offline (tests/conftest.py); this Hub is local, so it may talk to it.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield server
    server.stop()


def test_a_snapshot_with_only_what_a_conversion_reads(fake_hub, tiny_model_dir, tmp_path):
    source = sources.resolve("hf://org/tiny@v1", cache_dir=tmp_path)
    fetched = sorted(p.name for p in source.path.iterdir() if not p.name.startswith("."))
    assert fetched == sorted(p.name for p in tiny_model_dir.iterdir())
    # the same content as the folder it came from: the same digest, whatever the URI
    assert source.digest == sources.folder_digest(tiny_model_dir)[0]
    downloads = {path for method, path in fake_hub.requests if method == "GET" and "/resolve/" in path}
    assert downloads and all(f"/resolve/{COMMIT}/" in path for path in downloads)  # pinned to the commit
    assert not any(name in path for path in downloads for name in ("pytorch_model.bin", "README", "onnx/"))
    # a second resolve of the same commit downloads nothing again
    fake_hub.requests.clear()
    assert sources.resolve("hf://org/tiny", cache_dir=tmp_path, sha256=source.digest).path == source.path
    assert not any("/resolve/" in path for _, path in fake_hub.requests)


def test_private_repository_needs_the_token(fake_hub, tmp_path, monkeypatch):
    with pytest.raises(BadInputError, match="private and no HF_TOKEN was given"):
        sources.resolve("hf://org/private", cache_dir=tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(BadInputError, match="the HF_TOKEN given cannot read it"):
        sources.resolve("hf://org/private", cache_dir=tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert (sources.resolve("hf://org/private", cache_dir=tmp_path).path / "config.json").is_file()


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("hf://org/missing", "repository org/missing not found"),
        ("hf://org/tiny@nope", "no such revision"),
        ("hf://org/card-only", "no config.json"),
        ("hf://a/b/c", "names no Hub repository"),
        ("hf://org/..", "names no Hub repository"),
        ("hf://org/tiny@", "empty or malformed revision"),
    ],
)
def test_bad_sources_are_bad_input(fake_hub, tmp_path, uri, message):
    with pytest.raises(BadInputError, match=message):
        sources.resolve(uri, cache_dir=tmp_path)


def test_a_loopback_hub_is_refused_unless_allowed(fake_hub, tmp_path, monkeypatch):
    monkeypatch.delenv("MODELFLEET_SOURCE_ALLOW_HOSTS")
    with pytest.raises(BadInputError, match="HF_ENDPOINT"):
        sources.resolve("hf://org/tiny", cache_dir=tmp_path)
    assert fake_hub.requests == []


def test_a_digest_mismatch_is_refused(fake_hub, tmp_path):
    with pytest.raises(BadInputError, match="expected sha256:0000"):
        sources.resolve("hf://org/tiny", cache_dir=tmp_path, sha256="0" * 64)


def test_uri_parsing():
    assert hub.parse("hf://org/name") == ("org/name", "main")
    assert hub.parse("hf://gpt2@refs/pr/1") == ("gpt2", "refs/pr/1")


def test_convert_from_the_hub(fake_hub, tmp_path):
    summary = convert(
        Request(
            "hf://org/tiny@v1",
            "cpu",
            tmp_path / "out",
            format="torch",
            dtype="fp32",
            cache_dir=tmp_path,
        )
    )
    assert summary["ok"] and (tmp_path / "out" / "manifest.json").is_file()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"]["uri"] == "hf://org/tiny@v1"
