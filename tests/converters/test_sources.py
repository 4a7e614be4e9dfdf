"""Sources: local folders, file://, pvc:// under the mount root, http(s) with resume and sha256, s3://."""

from __future__ import annotations

import sys
import tarfile

import pytest
from modelfleet.converters import sources
from modelfleet.converters.convert import Request, convert
from modelfleet.converters.download import download, sha256_file
from modelfleet.converters.errors import BadInputError, ToolMissingError


def test_local_and_file_uri_share_a_content_digest(tiny_model_dir, tmp_path):
    by_path = sources.resolve(str(tiny_model_dir), cache_dir=tmp_path)
    by_uri = sources.resolve(tiny_model_dir.as_uri(), cache_dir=tmp_path)
    assert by_path.path == by_uri.path == tiny_model_dir
    assert by_path.digest == by_uri.digest and by_path.digest.startswith("sha256:")
    digest, files = sources.folder_digest(tiny_model_dir)
    assert {f["path"] for f in files} == {p.name for p in tiny_model_dir.iterdir()}
    sources.resolve(str(tiny_model_dir), cache_dir=tmp_path, sha256=digest)  # matches: no error
    with pytest.raises(BadInputError, match=r"has digest sha256:.*, expected sha256:0000"):
        sources.resolve(str(tiny_model_dir), cache_dir=tmp_path, sha256="0" * 64)


def test_unknown_scheme_is_refused(tmp_path):
    with pytest.raises(
        BadInputError, match="scheme 'ftp' is not supported; use one of: file, pvc, http, https, s3"
    ):
        sources.resolve("ftp://host/model", cache_dir=tmp_path)


def test_pvc_paths_map_under_the_mount_root(tiny_model_dir, tmp_path, monkeypatch):
    root = tmp_path / "pvc"
    (root / "models").mkdir(parents=True)
    (root / "models" / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    monkeypatch.setenv("MODELFLEET_PVC_ROOT", str(root))
    source = sources.resolve("pvc://models/tiny", cache_dir=tmp_path)
    assert source.path == root / "models" / "tiny"
    assert sources.to_pvc_uri(root / "artifacts" / "v1") == "pvc://artifacts/v1"
    assert sources.to_pvc_uri(tmp_path / "elsewhere") is None
    with pytest.raises(BadInputError, match="pvc://models/missing does not exist"):
        sources.resolve("pvc://models/missing", cache_dir=tmp_path)
    with pytest.raises(BadInputError, match="names no claim"):
        sources.resolve("pvc:///x", cache_dir=tmp_path)
    # An artifact written under the root is reported with its pvc:// URI, for the operator.
    summary = convert(Request("pvc://models/tiny", "cpu", root / "artifacts" / "v1", dtype="fp32"))
    assert summary["uri"] == "pvc://artifacts/v1"


def test_http_folder_download_resumes_after_a_dropped_connection(http_server, tiny_model_dir, tmp_path):
    http_server.flaky.add("model.safetensors")
    source = sources.resolve(http_server.url + "/", cache_dir=tmp_path)
    assert (source.path / "model.safetensors").read_bytes() == (
        tiny_model_dir / "model.safetensors"
    ).read_bytes()
    assert source.digest == sources.folder_digest(tiny_model_dir)[0]
    ranges = [r for name, r in http_server.requests if name == "model.safetensors"]
    assert ranges[0] is None and ranges[1] and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-"
    assert not list(source.path.glob("*.part"))
    # Optional files that the server lacks (404) are skipped; required ones are not.
    assert ("special_tokens_map.json", None) in http_server.requests
    with pytest.raises(BadInputError, match="HTTP 404"):
        sources.resolve(http_server.url + "/nowhere/", cache_dir=tmp_path)


def test_http_archive_with_sha256(serve, tiny_model_dir, tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    with tarfile.open(served / "model.tar.gz", "w:gz") as tar:
        tar.add(tiny_model_dir / "config.json", arcname="tiny/config.json")
        tar.add(tiny_model_dir / "model.safetensors", arcname="tiny/model.safetensors")
    server = serve(served)
    digest = sha256_file(served / "model.tar.gz")
    source = sources.resolve(f"{server.url}/model.tar.gz", cache_dir=tmp_path / "cache", sha256=digest)
    assert source.digest == f"sha256:{digest}"
    assert {p.name for p in source.path.iterdir()} == {"config.json", "model.safetensors"}
    with pytest.raises(BadInputError, match=r"sha256 of .*model\.tar\.gz is .*, expected 1111"):
        sources.resolve(f"{server.url}/model.tar.gz", cache_dir=tmp_path / "other", sha256="1" * 64)


def test_download_continues_a_part_file_left_by_an_earlier_run(http_server, tiny_model_dir, tmp_path):
    data = (tiny_model_dir / "tokenizer.json").read_bytes()
    dest = tmp_path / "tokenizer.json"
    (tmp_path / "tokenizer.json.part").write_bytes(data[:1000])
    download(f"{http_server.url}/tokenizer.json", dest, sha256=sha256_file(tiny_model_dir / "tokenizer.json"))
    assert dest.read_bytes() == data
    assert http_server.requests[-1] == ("tokenizer.json", "bytes=1000-")


def test_s3_without_s3fs_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as where s3fs is not installed
    with pytest.raises(
        ToolMissingError, match="s3:// sources need fsspec with its S3 backend: pip install s3fs"
    ):
        sources.resolve("s3://bucket/models/tiny", cache_dir=tmp_path)
