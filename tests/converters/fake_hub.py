"""A tiny Hugging Face Hub on 127.0.0.1: the few endpoints `huggingface_hub` calls to resolve a revision
and download a snapshot (model info, the file tree, file resolve with HEAD and GET), over repositories
held in memory, with an optional token per repository."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, bytes]
    # revision name (branch or tag) -> commit; the commit itself resolves too
    refs: dict[str, str] = field(default_factory=lambda: {"main": "a" * 40})
    token: str | None = None  # set: private, only this bearer token reads it

    def commit(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.refs.values() else None


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, body=False)

            def do_GET(self) -> None:
                hub.handle(self, body=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, req: http.server.BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(req.path).path)
        self.requests.append((req.command, path))
        info = re.fullmatch(r"/api/models/(.+?)/revision/([^/]+)", path)
        tree = re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(?:/.*)?", path)
        resolve = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
        match = info or tree or resolve
        if not match:
            return self.send(req, 404, {"error": "not found"}, body, error="Entry not found")
        repo = self.repos.get(match.group(1))
        token = (req.headers.get("authorization") or "").removeprefix("Bearer ")
        if repo is None or (repo.token and token != repo.token):
            # the Hub answers 401 with this code for both: a private repository is not disclosed
            return self.send(req, 401, {"error": "Repository not found"}, body, error="RepoNotFound")
        commit = repo.commit(match.group(2))
        if commit is None:
            return self.send(req, 404, {"error": "Revision not found"}, body, error="RevisionNotFound")
        if info:
            siblings = [{"rfilename": name} for name in sorted(repo.files)]
            data = {"id": match.group(1), "modelId": match.group(1), "sha": commit, "siblings": siblings}
            return self.send(req, 200, data, body)
        if tree:
            entries = [
                {"type": "file", "oid": _sha1(data), "size": len(data), "path": name}
                for name, data in sorted(repo.files.items())
            ]
            return self.send(req, 200, entries, body)
        name = match.group(3)
        if name not in repo.files:
            return self.send(req, 404, {"error": "Entry not found"}, body, error="EntryNotFound")
        data = repo.files[name]
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{_sha1(data)}"',
            "Content-Type": "application/octet-stream",
        }
        self.send_bytes(req, 200, data, body, headers)

    def send(self, req, status: int, data, body: bool, error: str | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if error:
            headers["X-Error-Code"] = error
            headers["X-Error-Message"] = data.get("error", error)
        self.send_bytes(req, status, json.dumps(data).encode(), body, headers)

    @staticmethod
    def send_bytes(req, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
