"""A Hugging Face Hub stand-in for the tests: the routes huggingface_hub calls, on a real socket.

``GET /api/models/{repo}[/revision/{rev}]`` (siblings; with ``?blobs=true`` their sizes, git ids and LFS
sha256), ``GET /api/models?search=`` and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with the headers
``hf_hub_download`` needs (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``, ``X-Linked-Size``,
``Content-Length``) and byte ranges (206). Errors carry the ``X-Error-Code`` huggingface_hub maps to its
exceptions. Faults on demand: drop the connection after N bytes once, stall after N bytes until
released, serve bytes that do not match the advertised sha256. Every request is logged.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import gguf

CHUNK = 1 << 20


@dataclass
class HubFile:
    content: bytes | Path
    lfs: bool = True
    served: bytes | None = None  # bytes sent instead of the content (a corrupt mirror)
    drop_after: int | None = None  # close the connection after this many body bytes, once
    stall_after: int | None = None  # stop after this many body bytes until ``release`` is set
    release: threading.Event = field(default_factory=threading.Event)

    def read(self) -> bytes:
        return self.content if isinstance(self.content, bytes) else self.content.read_bytes()

    @property
    def size(self) -> int:
        return len(self.content) if isinstance(self.content, bytes) else self.content.stat().st_size

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.read()).hexdigest()

    @property
    def blob_id(self) -> str:
        data = self.read() if not self.lfs else f"version https://git-lfs\noid sha256:{self.sha256}\n".encode()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id

    def body(self, start: int) -> bytes:
        data = self.served if self.served is not None else self.read()
        return data[start:]


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    sha: str = field(default_factory=lambda: secrets.token_hex(20))
    gated: bool = False
    tags: list[str] = field(default_factory=list)


@dataclass
class Logged:
    method: str
    path: str
    status: int = 0
    range_start: int | None = None
    sent: int = 0
    authorized: bool = False


class HubServer:
    """Start with ``with HubServer() as hub:``; point ``HF_ENDPOINT`` at ``hub.url``."""

    token = "hf_test_token"

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.log: list[Logged] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, files: dict[str, bytes | Path], *, gated: bool = False,
            tags: list[str] | None = None) -> HubRepo:
        repo = HubRepo(repo_id, {name: HubFile(content, lfs=not name.endswith((".json", ".md")))
                                 for name, content in files.items()}, gated=gated, tags=tags or [])
        self.repos[repo_id.lower()] = repo
        return repo

    def file(self, repo_id: str, name: str) -> HubFile:
        return self.repos[repo_id.lower()].files[name]

    def downloads(self, name: str) -> list[Logged]:
        """The GETs of a file's bytes, in order."""
        return [entry for entry in self.log if entry.method == "GET" and entry.path.endswith("/" + name)]

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        for repo in self.repos.values():
            for item in repo.files.values():
                item.release.set()
        self._server.shutdown()
        self._server.server_close()


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def _route(self, *, head: bool) -> None:
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            entry = Logged(self.command, path, authorized=self.headers.get("Authorization") == f"Bearer {hub.token}")
            hub.log.append(entry)
            try:
                if path == "/api/models":
                    self._search(entry, parse_qs(parts.query))
                elif (match := _INFO.match(path)) is not None:
                    self._info(entry, match["repo"], match["rev"] or "main", "blobs" in parse_qs(parts.query))
                elif (match := _RESOLVE.match(path)) is not None:
                    self._resolve(entry, match["repo"], match["rev"], match["file"], head)
                else:
                    self._error(entry, 404, None)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _error(self, entry: Logged, status: int, code: str | None, commit: str | None = None) -> None:
            entry.status = status
            body = json.dumps({"error": code or "not found"}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, entry: Logged, payload: Any) -> None:
            entry.status = 200
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo(self, entry: Logged, repo_id: str, revision: str) -> HubRepo | None:
            repo = hub.repos.get(repo_id.lower())
            if repo is None:
                self._error(entry, 401, "RepoNotFound")
                return None
            if revision not in ("main", repo.sha):
                self._error(entry, 404, "RevisionNotFound")
                return None
            return repo

        def _search(self, entry: Logged, query: dict[str, list[str]]) -> None:
            words = query.get("search", [""])[0].lower()
            found = [repo.repo_id for repo in hub.repos.values() if words and _similar(words, repo.repo_id.lower())]
            self._json(entry, [{"id": repo_id, "modelId": repo_id} for repo_id in found[:5]])

        def _info(self, entry: Logged, repo_id: str, revision: str, blobs: bool) -> None:
            repo = self._repo(entry, repo_id, revision)
            if repo is None:
                return
            siblings = []
            for name, item in repo.files.items():
                sibling: dict[str, Any] = {"rfilename": name}
                if blobs:
                    sibling.update(size=item.size if not item.lfs else 134, blobId=item.blob_id)
                    if item.lfs:
                        sibling["lfs"] = {"size": item.size, "sha256": item.sha256, "pointerSize": 134}
                siblings.append(sibling)
            self._json(entry, {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "private": False,
                               "gated": "manual" if repo.gated else False, "tags": repo.tags,
                               "library_name": "mlx" if "mlx" in repo.tags else None, "siblings": siblings})

        def _resolve(self, entry: Logged, repo_id: str, revision: str, name: str, head: bool) -> None:
            repo = self._repo(entry, repo_id, revision)
            if repo is None:
                return
            if repo.gated and not entry.authorized:
                self._error(entry, 403, "GatedRepo")
                return
            item = repo.files.get(name)
            if item is None:
                self._error(entry, 404, "EntryNotFound", repo.sha)
                return
            start = 0
            requested = self.headers.get("Range")
            if requested and not head:
                match = re.match(r"bytes=(\d+)-", requested)
                start = int(match.group(1)) if match else 0
                entry.range_start = start
            body = item.body(start) if not head else b""
            entry.status = 206 if start else 200
            self.send_response(entry.status)
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{item.etag}"')
            if item.lfs:
                self.send_header("X-Linked-Etag", f'"{item.sha256}"')
                self.send_header("X-Linked-Size", str(item.size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(item.size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{item.size - 1}/{item.size}")
            self.end_headers()
            if head:
                return
            self._send_body(entry, item, body, start)

        def _send_body(self, entry: Logged, item: HubFile, body: bytes, start: int) -> None:
            position = start
            for offset in range(0, len(body), CHUNK):
                piece = body[offset:offset + CHUNK]
                if item.drop_after is not None and position + len(piece) > item.drop_after:
                    cut = max(0, item.drop_after - position)
                    self.wfile.write(piece[:cut])
                    entry.sent += cut
                    item.drop_after = None  # once
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if item.stall_after is not None and position + len(piece) > item.stall_after:
                    cut = max(0, item.stall_after - position)
                    self.wfile.write(piece[:cut])
                    self.wfile.flush()
                    entry.sent += cut
                    item.stall_after = None
                    item.release.wait(120)
                    piece, position = piece[cut:], position + cut
                self.wfile.write(piece)
                entry.sent += len(piece)
                position += len(piece)

    return Handler


def _similar(words: str, repo_id: str) -> bool:
    name = repo_id.split("/")[-1]
    return words in name or name in words or len(set(words.split("-")) & set(name.split("-"))) >= 2


def split_gguf(source: Path, destination: Path, parts: int = 2) -> list[Path]:
    """A real split of a GGUF (llama.cpp's -0000k-of-0000n layout), made with the gguf package."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    per_part = -(-len(reader.tensors) // parts)
    writer = gguf.GGUFWriter(destination, arch, split_max_tensors=per_part)
    for item in reader.fields.values():
        if item.name == gguf.Keys.General.ARCHITECTURE or item.name.startswith("GGUF."):
            continue
        kind = item.types[0]
        sub = item.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(item.name, item.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return sorted(destination.parent.glob(f"{destination.stem}-*-of-*.gguf"))
