"""hf://ORG/NAME[@REVISION] sources: a model repository of the Hugging Face Hub, or of a mirror at
`HF_ENDPOINT`, fetched with `huggingface_hub` (Xet storage included).

The revision (a branch, tag or commit; `main` when none is given) is resolved to its commit first, so
the download, the cache folder and the digest all name one immutable snapshot. Only the files a
conversion reads are fetched (config, safetensors, tokenizer, chat template), from the repository's top
folder: other formats' weights and subfolders stay on the Hub. A private or gated repository needs a
token in `HF_TOKEN` (in a cluster, from the Secret the ModelVersion names).

The endpoint's host passes the same policy as http(s) sources (MODELFLEET_SOURCE_ALLOW_HOSTS, private
addresses refused) before anything is asked of it; the Hub's own redirects to its storage are followed
by `huggingface_hub`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import httpx
from modelfleet.converters.errors import BadInputError, ConversionError
from modelfleet.converters.hosts import HostPolicy

SCHEME = "hf"
DEFAULT_ENDPOINT = "https://huggingface.co"
ENDPOINT_ENV, TOKEN_ENV = "HF_ENDPOINT", "HF_TOKEN"
# What a conversion reads (see preflight.py and the files the artifact copies).
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
]
IGNORE_PATTERNS = ["*/*"]  # subfolders: other exports (onnx/, original/...), never what we convert
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def parse(uri: str) -> tuple[str, str]:
    """hf://ORG/NAME[@REVISION] -> (repo id, revision)."""
    rest = uri.removeprefix(f"{SCHEME}://")
    repo, _, revision = rest.partition("@")
    parts = repo.split("/")
    if not 1 <= len(parts) <= 2 or not all(_REPO_PART.match(p) and ".." not in p for p in parts):
        raise BadInputError(f"source URI {uri!r} names no Hub repository; use hf://ORG/NAME[@REVISION]")
    if ("@" in uri and not revision.strip()) or any(c.isspace() for c in revision):
        raise BadInputError(f"source URI {uri!r} has an empty or malformed revision after '@'")
    return repo, revision or "main"


def endpoint() -> str:
    return os.environ.get(ENDPOINT_ENV, "").strip().rstrip("/") or DEFAULT_ENDPOINT


def fetch(uri: str, cache_dir: Path) -> Path:
    """The snapshot's local folder (downloaded once per endpoint, repository and commit)."""
    from huggingface_hub import HfApi, snapshot_download

    repo, revision = parse(uri)
    hub = endpoint()
    try:
        HostPolicy.from_env().address(httpx.URL(hub))
    except BadInputError as exc:
        raise BadInputError(f"{ENDPOINT_ENV} {hub}: {exc}") from None
    token = os.environ.get(TOKEN_ENV) or None
    commit = _call(
        uri, repo, hub, lambda: HfApi(endpoint=hub, token=token).model_info(repo, revision=revision).sha
    )
    if not isinstance(commit, str) or not _COMMIT.match(commit):
        raise BadInputError(f"source {uri}: the Hub at {hub} answered no commit for revision {revision!r}")
    key = hashlib.sha256(f"{hub}/{repo}@{commit}".encode()).hexdigest()[:16]
    folder = cache_dir / f"hf-{key}" / "model"
    if (folder / "config.json").is_file():
        return folder
    staging = folder.with_name("model.partial")
    shutil.rmtree(staging, ignore_errors=True)
    _call(
        uri,
        repo,
        hub,
        lambda: snapshot_download(
            repo,
            revision=commit,
            endpoint=hub,
            token=token,
            local_dir=staging,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        ),
    )
    if not (staging / "config.json").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        raise BadInputError(
            f"source {uri} has no config.json at commit {commit}; is it a transformers model?"
        )
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def _call(uri: str, repo: str, hub: str, work):
    """Hub errors in one line: a wrong name, revision or token is bad input (no retry), the rest
    (network, a Hub outage) a failure the operator retries."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return work()
    except RevisionNotFoundError:
        raise BadInputError(f"source {uri}: no such revision in {repo} on {hub}") from None
    except GatedRepoError:
        raise BadInputError(
            f"source {uri}: {repo} is gated; accept its terms on the Hub and give a token in {TOKEN_ENV}"
        ) from None
    except RepositoryNotFoundError:
        why = (
            f"or the {TOKEN_ENV} given cannot read it"
            if os.environ.get(TOKEN_ENV)
            else f"or it is private and no {TOKEN_ENV} was given"
        )
        raise BadInputError(f"source {uri}: repository {repo} not found on {hub}, {why}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise BadInputError(
                f"source {uri}: {hub} refused access (HTTP {status}); check {TOKEN_ENV}"
            ) from None
        raise ConversionError(f"source {uri}: the Hub at {hub} failed: {_first_line(exc)}") from None
    except Exception as exc:  # huggingface_hub's HTTP client raises its own types; all are retried
        raise ConversionError(f"source {uri}: cannot fetch from {hub}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
