"""Turn a source URI (folder, file://, pvc://, http(s)://, s3://, hf://) into a local model folder and
its digest.

The source digest is the sha256 of the sorted lines "<sha256 of file>  <relative path>" over the folder's
files (what `sha256sum` prints), so it names the content whatever the URI; an archive source's digest is
the archive's own sha256. `--sha256` is checked against it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlparse

import httpx
from modelfleet.converters.confine import check_name, check_relative, index_shards, regular_files
from modelfleet.converters.download import NotFound, download, new_client, sha256_file
from modelfleet.converters.errors import BadInputError, ToolMissingError
from modelfleet.converters.hosts import HostPolicy

SCHEMES = ("file", "pvc", "http", "https", "s3", "hf")
PVC_ROOT_ENV = "MODELFLEET_PVC_ROOT"
DEFAULT_PVC_ROOT = "/mnt/pvc"
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
# What an http(s) folder source may hold; a server cannot list a folder, so we ask for each by name.
OPTIONAL_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class Source:
    uri: str
    path: Path  # a local folder holding config.json and safetensors
    digest: str  # "sha256:<hex>"


def pvc_root() -> Path:
    return Path(os.environ.get(PVC_ROOT_ENV, DEFAULT_PVC_ROOT))


def pvc_path(uri: str) -> Path:
    """pvc://CLAIM/PATH -> <pvc root>/CLAIM/PATH: the operator mounts each claim under the root by name.
    The path, symlinks resolved, must stay inside the claim's folder: `..` cannot reach another claim."""
    parsed = urlparse(uri)
    if not parsed.netloc:
        raise BadInputError(f"source URI {uri!r} names no claim; use pvc://CLAIM/PATH")
    claim = pvc_root() / check_name(parsed.netloc, f"source URI {uri!r} claim")
    path = claim / parsed.path.lstrip("/")
    if not path.resolve().is_relative_to(claim.resolve()):
        raise BadInputError(f"source URI {uri!r} leads out of its claim's folder {claim}")
    return path


def to_pvc_uri(path: Path) -> str | None:
    """The pvc:// URI of a path under the pvc root, or None when it lies elsewhere."""
    try:
        rel = path.absolute().relative_to(pvc_root().absolute())
    except ValueError:
        return None
    return f"pvc://{rel.as_posix()}"


def folder_digest(folder: Path, exclude: tuple[str, ...] = ()) -> tuple[str, list[dict]]:
    """("sha256:<hex>", [{path, sha256, size}]) over every file under `folder`, sorted by path."""
    files = []
    for rel, path in regular_files(folder):  # refuses symlinks out of the folder, FIFOs, devices
        if rel in exclude:
            continue
        try:
            files.append({"path": rel, "sha256": sha256_file(path), "size": path.stat().st_size})
        except OSError as exc:
            raise BadInputError(f"{rel} in {folder} cannot be read ({exc.strerror or exc})") from None
    listing = "".join(f"{f['sha256']}  {f['path']}\n" for f in files)
    return "sha256:" + hashlib.sha256(listing.encode()).hexdigest(), files


def resolve(uri: str, *, cache_dir: Path, sha256: str | None = None) -> Source:
    """Make the source available locally; BadInputError / ToolMissingError in one line otherwise."""
    expected = sha256.removeprefix("sha256:").lower() if sha256 else None
    parsed = urlparse(uri)
    scheme = parsed.scheme or "file"
    if scheme not in SCHEMES:
        raise BadInputError(
            f"source URI scheme {scheme!r} is not supported; use one of: {', '.join(SCHEMES)}"
        )
    if scheme == "file":
        path = Path(parsed.path if parsed.scheme else uri)
        return _local(uri, path, expected, cache_dir)
    if scheme == "pvc":
        return _local(uri, pvc_path(uri), expected, cache_dir)
    if scheme in ("http", "https"):
        return _http(uri, expected, cache_dir)
    if scheme == "hf":
        from modelfleet.converters import hub  # huggingface_hub is slow to import: only when used

        folder = hub.fetch(uri, cache_dir)
        digest, _ = folder_digest(folder)
        _check_digest(uri, digest, expected)
        return Source(uri, folder, digest)
    return _s3(uri, expected, cache_dir)


def _check_digest(uri: str, digest: str, expected: str | None) -> None:
    if expected and digest.removeprefix("sha256:") != expected:
        raise BadInputError(f"source {uri} has digest {digest}, expected sha256:{expected}")


def _local(uri: str, path: Path, expected: str | None, cache_dir: Path) -> Source:
    if not path.exists():
        raise BadInputError(f"source {uri} does not exist (looked at {path})")
    if path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES):
        digest = "sha256:" + sha256_file(path)
        _check_digest(uri, digest, expected)
        return Source(uri, _extract(path, cache_dir / digest.removeprefix("sha256:")), digest)
    if not path.is_dir():
        raise BadInputError(
            f"source {uri} is not a folder; give the model's folder (with config.json) or a .tar"
        )
    digest, _ = folder_digest(path)
    _check_digest(uri, digest, expected)
    return Source(uri, path, digest)


def _extract(archive: Path, dest: Path) -> Path:
    if (dest / "config.json").exists():
        return dest
    staging = dest.with_name(dest.name + ".extracting")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")  # refuses absolute paths, .. and links out of the folder
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise BadInputError(f"source archive {archive.name} cannot be read: {exc}") from None
    # An archive of one top folder is that folder.
    entries = list(staging.iterdir())
    root = entries[0] if len(entries) == 1 and entries[0].is_dir() else staging
    shutil.rmtree(dest, ignore_errors=True)
    root.rename(dest)
    shutil.rmtree(staging, ignore_errors=True)
    return dest


def _http(uri: str, expected: str | None, cache_dir: Path) -> Source:
    key = hashlib.sha256(uri.encode()).hexdigest()[:16]
    policy = HostPolicy.from_env()
    policy.address(httpx.URL(uri))  # a refused host is refused before anything is written
    with new_client() as client:
        if urlparse(uri).path.endswith(ARCHIVE_SUFFIXES):
            name = check_name(urlparse(uri).path.rsplit("/", 1)[-1], "source archive")
            archive = _get(client, uri, cache_dir / key / name, policy, expected)
            digest = "sha256:" + (expected or sha256_file(archive))
            return Source(uri, _extract(archive, cache_dir / key / "model"), digest)
        base = uri.rstrip("/") + "/"
        folder = cache_dir / key / "model"
        _get(client, base + "config.json", folder / "config.json", policy)
        for name in OPTIONAL_FILES:
            with contextlib.suppress(NotFound):  # optional files
                _get(client, base + name, folder / name, policy, required=False)
        try:
            name = "model.safetensors.index.json"
            index = _get(client, base + name, folder / name, policy, required=False)
        except NotFound:
            _get(client, base + "model.safetensors", folder / "model.safetensors", policy)
        else:
            for shard in index_shards(index):  # plain file names, checked before any is fetched
                _get(client, base + quote(shard), folder / shard, policy)
    digest, _ = folder_digest(folder)
    _check_digest(uri, digest, expected)
    return Source(uri, folder, digest)


def _get(
    client: httpx.Client,
    url: str,
    dest: Path,
    policy: HostPolicy,
    sha256: str | None = None,
    required: bool = True,
) -> Path:
    """Download one file; a 404 is BadInputError when the file is required, else NotFound for the caller."""
    try:
        return download(url, dest, sha256=sha256, client=client, policy=policy)
    except NotFound:
        if required:
            raise BadInputError(f"GET {url} answered HTTP 404; check the source URI") from None
        raise
    except httpx.HTTPError as exc:
        raise BadInputError(f"cannot fetch {url}: {exc}") from None


def _s3(uri: str, expected: str | None, cache_dir: Path) -> Source:
    try:
        import fsspec

        fs = fsspec.filesystem("s3")
    except ImportError:
        raise ToolMissingError(
            "s3:// sources need fsspec with its S3 backend: pip install s3fs (credentials from the usual "
            "AWS_* variables)"
        ) from None
    folder = cache_dir / hashlib.sha256(uri.encode()).hexdigest()[:16] / "model"
    if not (folder / "config.json").exists():
        staging = folder.with_name("model.partial")
        shutil.rmtree(staging, ignore_errors=True)
        root = uri.removeprefix("s3://").rstrip("/")
        try:
            keys, local = [], []
            for key in fs.find(root):
                rel = key.removeprefix(root + "/")
                if any(p.startswith(".") and p not in (".", "..") for p in rel.split("/")):
                    continue  # hidden, as in a local folder (.gitattributes)
                # A key may hold '..' or start with '/': it must be a relative path inside the folder.
                local.append(str(staging / check_relative(rel, f"source {uri} object")))
                keys.append(key)
            fs.get(keys, local)
        except BadInputError:
            raise
        except Exception as exc:  # botocore and aiohttp raise their own types
            shutil.rmtree(staging, ignore_errors=True)
            raise BadInputError(f"cannot fetch {uri}: {exc}") from None
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    digest, _ = folder_digest(folder)
    _check_digest(uri, digest, expected)
    return Source(uri, folder, digest)
