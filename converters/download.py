"""Streamed HTTP(S) downloads that resume with Range after a broken connection and check a sha256.

Every request goes to an address the host policy checked (hosts.py); redirects are followed by hand, at
most MAX_REDIRECTS hops, each checked the same way before anything is sent to it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urljoin

import httpx
from modelfleet.converters import progress
from modelfleet.converters.errors import BadInputError, ConversionError
from modelfleet.converters.hosts import HostPolicy, pinned_request

CHUNK = 1 << 20
ATTEMPTS = 5
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)


class NotFound(Exception):
    """The server answered 404: the caller decides whether that file was optional."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def new_client() -> httpx.Client:
    """The client for source downloads: redirects are ours to follow (see `_open`)."""
    return httpx.Client(follow_redirects=False, timeout=httpx.Timeout(30.0, read=120.0))


def download(
    url: str,
    dest: Path,
    *,
    sha256: str | None = None,
    client: httpx.Client | None = None,
    policy: HostPolicy | None = None,
) -> Path:
    """Fetch `url` into `dest`. Bytes land in `dest.part` first; a retry (or a later run of the Job) asks
    the server for the rest with a Range header, so a dropped connection costs only what was not yet read.
    `policy` (default: from the environment) says which hosts may be reached.
    """
    policy = policy or HostPolicy.from_env()
    if dest.exists() and (sha256 is None or sha256_file(dest) == sha256):
        return dest
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    own_client = client is None
    client = client or new_client()
    try:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                _fetch(client, url, part, policy)
                break
            except (httpx.TransportError, _ShortRead) as exc:
                if attempt == ATTEMPTS:
                    raise ConversionError(
                        f"download of {url} failed after {ATTEMPTS} attempts: {exc}"
                    ) from None
                progress.log(f"download of {url} interrupted ({exc}); resuming (attempt {attempt + 1})")
                time.sleep(min(2 ** (attempt - 1), 10) * 0.1)
    finally:
        if own_client:
            client.close()
    if sha256 is not None:
        got = sha256_file(part)
        if got != sha256:
            part.unlink()
            raise BadInputError(
                f"sha256 of {url} is {got}, expected {sha256}: the source changed or is corrupt"
            )
    part.rename(dest)
    return dest


class _ShortRead(Exception):
    pass


@contextmanager
def _open(
    client: httpx.Client, url: str, headers: dict[str, str], policy: HostPolicy
) -> Iterator[httpx.Response]:
    """GET `url`, following redirects one checked hop at a time; yields the final response, streaming."""
    for _ in range(MAX_REDIRECTS + 1):
        response = client.send(pinned_request(client, url, headers, policy), stream=True)
        try:
            location = response.headers.get("location")
            if response.status_code not in REDIRECTS or not location:
                yield response
                return
        finally:
            response.close()
        target = urljoin(url, location)
        try:
            policy.address(httpx.URL(target))
        except BadInputError as exc:
            raise BadInputError(f"redirect from {url} to {target} refused: {exc}") from None
        url = target
    raise BadInputError(f"GET {url}: more than {MAX_REDIRECTS} redirects")


def _fetch(client: httpx.Client, url: str, part: Path, policy: HostPolicy) -> None:
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with _open(client, url, headers, policy) as response:
        if response.status_code == 404:
            raise NotFound(url)
        if response.status_code == 416:  # we already hold every byte
            return
        if response.status_code not in (200, 206):
            raise BadInputError(f"GET {url} answered HTTP {response.status_code}; check the source URI")
        if response.status_code == 200:
            have = 0  # the server ignored Range: start over
        total = _total_size(response, have)
        with (
            part.open("ab" if have else "wb") as f,
            progress.task(f"download {url.rsplit('/', 1)[-1]}", total, bytes_=True) as bar,
        ):
            bar.advance(have)
            for block in response.iter_bytes():  # as received: a drop loses nothing already read
                f.write(block)
                have += len(block)
                bar.advance(len(block))
    if total is not None and have < total:
        raise _ShortRead(f"got {have} of {total} bytes")


def _total_size(response: httpx.Response, offset: int) -> int | None:
    if response.status_code == 206 and "content-range" in response.headers:
        size = response.headers["content-range"].rsplit("/", 1)[-1]
        return int(size) if size.isdigit() else None
    length = response.headers.get("content-length")
    return offset + int(length) if length and length.isdigit() else None
