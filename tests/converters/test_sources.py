"""Sources: local folders, file://, pvc:// under the mount root, http(s) with resume and sha256, s3://."""

from __future__ import annotations

import http.server
import ipaddress
import json
import re
import shutil
import socket
import sys
import tarfile
import threading

import fsspec
import httpx
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from modelfleet.converters import hosts, sources
from modelfleet.converters.convert import Request, convert
from modelfleet.converters.download import download, sha256_file
from modelfleet.converters.errors import BadInputError, ConversionError, ToolMissingError


@pytest.fixture
def allow_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test servers listen on 127.0.0.1, which a source may reach only when the allow list says so."""
    monkeypatch.setenv("MODELFLEET_SOURCE_ALLOW_HOSTS", "127.0.0.1")


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
        BadInputError, match="scheme 'ftp' is not supported; use one of: file, pvc, http, https, s3, hf"
    ):
        sources.resolve("ftp://host/model", cache_dir=tmp_path)


def test_pvc_paths_map_under_the_mount_root(tiny_model_dir, tmp_path, monkeypatch):
    root = tmp_path / "pvc"
    shutil.copytree(tiny_model_dir, root / "models" / "tiny")
    monkeypatch.setenv("MODELFLEET_PVC_ROOT", str(root))
    source = sources.resolve("pvc://models/tiny", cache_dir=tmp_path)
    assert source.path == root / "models" / "tiny"
    assert sources.to_pvc_uri(root / "artifacts" / "v1") == "pvc://artifacts/v1"
    assert sources.to_pvc_uri(tmp_path / "elsewhere") is None
    with pytest.raises(BadInputError, match="pvc://models/missing does not exist"):
        sources.resolve("pvc://models/missing", cache_dir=tmp_path)
    with pytest.raises(BadInputError, match="names no claim"):
        sources.resolve("pvc:///x", cache_dir=tmp_path)
    # A path that leaves its claim's folder (by `..` or by a symlink) is refused, whatever lies there.
    (root / "other").mkdir()
    shutil.copytree(tiny_model_dir, root / "other" / "tiny")
    (root / "models" / "link").symlink_to(tiny_model_dir, target_is_directory=True)
    for uri in ("pvc://models/../other/tiny", "pvc://models/tiny/../../../x", "pvc://models/link"):
        with pytest.raises(
            BadInputError, match=f"source URI '{re.escape(uri)}' leads out of its claim's folder"
        ):
            sources.resolve(uri, cache_dir=tmp_path)
    with pytest.raises(BadInputError, match=r"claim '\.\.' is not a plain file name"):
        sources.resolve("pvc://../pvc/models/tiny", cache_dir=tmp_path)
    # An artifact written under the root is reported with its pvc:// URI, for the operator.
    summary = convert(Request("pvc://models/tiny", "cpu", root / "artifacts" / "v1", dtype="fp32"))
    assert summary["uri"] == "pvc://artifacts/v1"


def test_http_folder_download_resumes_after_a_dropped_connection(
    http_server, tiny_model_dir, tmp_path, allow_loopback
):
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


def test_http_archive_with_sha256(serve, tiny_model_dir, tmp_path, allow_loopback):
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


def test_download_continues_a_part_file_left_by_an_earlier_run(
    http_server, tiny_model_dir, tmp_path, allow_loopback
):
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


# --- which hosts an http(s) source may reach ---------------------------------------------------------------


class RedirectServer(http.server.ThreadingHTTPServer):
    """Answers GET /NAME with a 302 to `to(NAME)`."""

    def __init__(self, to) -> None:
        super().__init__(("127.0.0.1", 0), _Redirect)
        self.to = to

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Redirect(http.server.BaseHTTPRequestHandler):
    server: RedirectServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.server.to(self.path.lstrip("/")))
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def redirect_server():
    servers = []

    def start(to) -> RedirectServer:
        server = RedirectServer(to)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The addresses every outgoing TCP connection of the test went to."""
    seen: list[str] = []
    real = socket.create_connection

    def record(address, *args, **kwargs):
        seen.append(address[0])
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", record)
    return seen


def test_loopback_source_is_refused_by_default(http_server, tmp_path, monkeypatch, connections):
    monkeypatch.delenv("MODELFLEET_SOURCE_ALLOW_HOSTS", raising=False)
    with pytest.raises(
        BadInputError, match=r"source host 127\.0\.0\.1 resolves to 127\.0\.0\.1, a loopback address"
    ):
        sources.resolve(http_server.url + "/", cache_dir=tmp_path / "cache")
    assert http_server.requests == [] and connections == [] and not (tmp_path / "cache").exists()


def test_redirects_are_followed_hop_by_hop_and_capped(
    http_server, redirect_server, tiny_model_dir, tmp_path, allow_loopback
):
    moved = redirect_server(lambda name: f"{http_server.url}/{name}")
    source = sources.resolve(moved.url + "/", cache_dir=tmp_path)
    assert source.digest == sources.folder_digest(tiny_model_dir)[0]
    loop = redirect_server(lambda name: f"/{name}")
    with pytest.raises(BadInputError, match=r"GET .*/config\.json: more than 5 redirects"):
        sources.resolve(loop.url + "/", cache_dir=tmp_path / "loop")


def test_redirect_to_the_metadata_address_is_refused_without_connecting(
    redirect_server, tmp_path, allow_loopback, connections
):
    server = redirect_server(lambda name: "http://169.254.169.254/latest/meta-data/")
    with pytest.raises(
        BadInputError,
        match=f"redirect from {server.url}/config.json to http://169.254.169.254/latest/meta-data/ refused: "
        r"source host 169\.254\.169\.254 \(169\.254\.169\.254\) is not in MODELFLEET_SOURCE_ALLOW_HOSTS",
    ):
        sources.resolve(server.url + "/", cache_dir=tmp_path)
    assert connections and set(connections) == {"127.0.0.1"}


def test_redirect_to_a_private_address_is_refused_by_default(monkeypatch, tmp_path, connections):
    # A public host (as DNS says) whose answer redirects into the cluster: the hop is checked too.
    public = {"models.example": "93.184.215.14"}
    monkeypatch.setattr(hosts, "resolve", lambda host, port: [ipaddress.ip_address(public.get(host, host))])
    policy = hosts.HostPolicy.from_env({})
    assert policy.address(httpx.URL("https://models.example/x")) == "93.184.215.14"
    transport = httpx.MockTransport(
        lambda request: httpx.Response(302, headers={"Location": "http://10.0.0.7/"})
    )
    with httpx.Client(transport=transport) as client, pytest.raises(
        BadInputError, match=r"to http://10\.0\.0\.7/ refused: .*10\.0\.0\.7, a private address"
    ):  # fmt: skip
        download("https://models.example/x", tmp_path / "x", client=client, policy=policy)
    assert connections == []


def test_the_connection_goes_to_the_checked_address(
    http_server, tiny_model_dir, tmp_path, monkeypatch, connections
):
    # DNS answers 127.0.0.1 (allowed) to the check, then the metadata address: a client that resolved the
    # name again to connect would go there. The pinned request does not ask DNS again.
    monkeypatch.setenv("MODELFLEET_SOURCE_ALLOW_HOSTS", "127.0.0.0/8")
    answers = iter(["127.0.0.1", "169.254.169.254", "169.254.169.254"])
    real = socket.getaddrinfo

    def rebinding(host, *args, **kwargs):
        if host == "models.internal":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    port = http_server.server_address[1]
    dest = download(f"http://models.internal:{port}/tokenizer.json", tmp_path / "tokenizer.json")
    assert dest.read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert set(connections) == {"127.0.0.1"}
    with pytest.raises(BadInputError, match=r"models\.internal \(169\.254\.169\.254\) is not in"):
        download(f"http://models.internal:{port}/config.json", tmp_path / "config.json")
    assert set(connections) == {"127.0.0.1"}


def test_http_shard_names_are_checked_before_anything_is_fetched(
    serve, tiny_model_dir, tmp_path, allow_loopback
):
    served = tmp_path / "served" / "model"
    shutil.copytree(tiny_model_dir, served)
    (served / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "../../../outside.safetensors"}})
    )
    server = serve(served)
    cache = tmp_path / "cache"
    with pytest.raises(
        BadInputError, match=r"'\.\./\.\./\.\./outside\.safetensors' is not a plain file name"
    ):
        sources.resolve(server.url + "/", cache_dir=cache)
    assert not [name for name, _ in server.requests if name.endswith(".safetensors")]
    written = {p.relative_to(cache).parts[1:] for p in cache.rglob("*") if p.is_file()}
    assert ("model", "model.safetensors.index.json") in written
    assert all(parts[0] == "model" for parts in written) and not list(tmp_path.rglob("outside*"))


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("172.16.0.1", "private"),
        ("192.168.1.1", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
        ("fd00::1", "private"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
        ("::ffff:127.0.0.1", "loopback"), ("100.64.0.1", "non-global"), ("224.0.0.1", "multicast"),
        ("8.8.8.8", None), ("2606:4700::1111", None),
    ],
)  # fmt: skip
def test_non_public_addresses(address, kind):
    assert hosts.non_public(ipaddress.ip_address(address)) == kind


def test_host_policy_settings(monkeypatch):
    policy = hosts.HostPolicy.from_env({})
    assert policy.deny_private and not policy.names and not policy.networks
    policy = hosts.HostPolicy.from_env(
        {
            "MODELFLEET_SOURCE_ALLOW_HOSTS": " Mirror.Internal. , 10.0.0.0/8,::1",
            "MODELFLEET_SOURCE_DENY_PRIVATE": "no",
        }
    )
    assert policy.names == {"mirror.internal"} and not policy.deny_private
    assert [str(n) for n in policy.networks] == ["10.0.0.0/8", "::1/128"]
    monkeypatch.setattr(hosts, "resolve", lambda host, port: [ipaddress.ip_address("10.9.8.7")])
    assert policy.address(httpx.URL("http://mirror.internal/m")) == "10.9.8.7"
    assert policy.address(httpx.URL("http://elsewhere/m")) == "10.9.8.7"  # in 10.0.0.0/8
    monkeypatch.setattr(hosts, "resolve", lambda host, port: [ipaddress.ip_address("8.8.8.8")])
    with pytest.raises(BadInputError, match=r"source host public\.example \(8\.8\.8\.8\) is not in"):
        policy.address(httpx.URL("https://public.example/m"))  # a list, once set, is all that is allowed
    with pytest.raises(BadInputError, match="MODELFLEET_SOURCE_ALLOW_HOSTS entry 'a b' is not a host name"):
        hosts.HostPolicy.from_env({"MODELFLEET_SOURCE_ALLOW_HOSTS": "a b"})
    with pytest.raises(BadInputError, match="MODELFLEET_SOURCE_DENY_PRIVATE='maybe': use true or false"):
        hosts.HostPolicy.from_env({"MODELFLEET_SOURCE_DENY_PRIVATE": "maybe"})


class FakeS3(MemoryFileSystem):
    """An in-memory stand-in for s3fs: keys are 'bucket/key', as s3fs lists them."""

    protocol = "s3"
    cachable = False

    @classmethod
    def _strip_protocol(cls, path):
        return str(path).removeprefix("s3://").strip("/")


@pytest.fixture
def fake_s3(monkeypatch: pytest.MonkeyPatch) -> FakeS3:
    monkeypatch.setattr(FakeS3, "store", {})
    monkeypatch.setattr(FakeS3, "pseudo_dirs", [""])
    monkeypatch.setattr(fsspec, "filesystem", lambda protocol: FakeS3())
    return FakeS3()


def test_s3_objects_land_inside_the_cache_folder(fake_s3, tiny_model_dir, tmp_path):
    for path in tiny_model_dir.iterdir():
        fake_s3.pipe(f"bucket/models/tiny/{path.name}", path.read_bytes())
    fake_s3.pipe("bucket/models/tiny/.gitattributes", b"*.safetensors filter=lfs")  # hidden: skipped
    source = sources.resolve("s3://bucket/models/tiny/", cache_dir=tmp_path / "cache")
    assert source.digest == sources.folder_digest(tiny_model_dir)[0]
    assert not (source.path / ".gitattributes").exists()

    fake_s3.pipe("bucket/models/evil/config.json", b"{}")
    fake_s3.pipe("bucket/models/evil/a/../../../../escaped.json", b"{}")
    with pytest.raises(
        BadInputError, match=r"object 'a/\.\./\.\./\.\./\.\./escaped\.json' is not a relative path"
    ):
        sources.resolve("s3://bucket/models/evil", cache_dir=tmp_path / "cache")
    assert not list(tmp_path.rglob("escaped.json"))


def test_a_host_dns_cannot_resolve_is_a_failure_worth_a_retry(monkeypatch, tmp_path):
    def down(*args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", down)
    with pytest.raises(ConversionError, match=r"host models\.example cannot be resolved: .*Temporary") as exc:
        sources.resolve("https://models.example/m/", cache_dir=tmp_path / "cache")
    assert exc.value.exit_code == 1 and not (tmp_path / "cache").exists()
