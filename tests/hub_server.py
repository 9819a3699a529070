"""A loopback stand-in for the Hugging Face Hub's HTTP API, serving folders as repositories.

`sharded_copy` makes a repository to serve: tiny-llama cut into shards, as big checkpoints
come. Only what `huggingface_hub.snapshot_download` asks for: repository info at a revision, the
recursive file tree, and file downloads (HEAD and GET under `resolve/`). A repository can
require a token (401 without it, as the Hub answers for a private repository). Every request
path is recorded, so a test can check what was (not) downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from safetensors.torch import load_file, save_file

from pdserve.models.builtin import resolve_model
from pdserve.models.loader import weight_files

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def sharded_copy(dst: Path, n_shards: int = 3) -> Path:
    """tiny-llama's checkpoint cut into `n_shards` files with an index, round-robin over the
    sorted names: each layer's q_proj, k_proj and v_proj land in different shards."""
    src = resolve_model("tiny-llama")
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != ".complete":
            (dst / f.name).write_bytes(f.read_bytes())
    state = {}
    for f in weight_files(src):
        state.update(load_file(str(f)))
    names = sorted(state)
    weight_map = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in names[i::n_shards]}
        save_file(part, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return dst


class HubServer:
    def __init__(self, repos: dict[str, Path], token: str = "") -> None:
        self.repos = repos
        self.token = token  # "" = public
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def downloads(self) -> list[str]:
        """File names fetched with GET under resolve/."""
        return [p.rsplit("/", 1)[-1] for p in self.requests
                if p.startswith("GET ") and "/resolve/" in p]

    # ---- request handling ----------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(f"{h.command} {path}")
        repo, rest = self._split(path)
        if repo is None:
            return self._send(h, 404, {"error": "Repository not found"}, body,
                              {"X-Error-Code": "RepoNotFound"})
        if self.token and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._send(h, 401, {"error": "Invalid credentials"}, body,
                              {"X-Error-Code": "RepoNotFound"})
        folder = self.repos[repo]
        if rest[0] == "api":
            kind = rest[1]
            if kind == "revision":
                if rest[2] not in ("main", COMMIT):
                    return self._send(h, 404, {"error": "Revision not found"}, body,
                                      {"X-Error-Code": "RevisionNotFound"})
                return self._send(h, 200, {"id": repo, "sha": COMMIT, "siblings": [
                    {"rfilename": f.name} for f in sorted(folder.iterdir()) if f.is_file()]},
                    body)
            if kind == "tree":
                return self._send(h, 200, [self._entry(f) for f in sorted(folder.iterdir())
                                           if f.is_file()], body)
            return self._send(h, 404, {"error": "unknown api"}, body)
        # resolve/<revision>/<file>
        name = "/".join(rest[2:])
        f = folder / name
        if rest[0] != "resolve" or not f.is_file():
            return self._send(h, 404, {"error": "Entry not found"}, body,
                              {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
        data = f.read_bytes()
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{_sha256(f)}"')
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _split(self, path: str) -> tuple[str | None, list[str]]:
        """'/api/models/ORG/NAME/revision/main' or '/ORG/NAME/resolve/REV/FILE' ->
        (repo, ['api', 'revision', 'main']) / (repo, ['resolve', REV, FILE])."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "models"] and len(parts) >= 5:
            repo = "/".join(parts[2:4])
            rest = ["api", parts[4], *parts[5:]]
        elif len(parts) >= 4:
            repo = "/".join(parts[:2])
            rest = parts[2:]
        else:
            return None, []
        return (repo if repo in self.repos else None), rest

    @staticmethod
    def _entry(f: Path) -> dict:
        size = f.stat().st_size
        entry = {"type": "file", "path": f.name, "size": size, "oid": _git_oid(f)}
        if f.suffix == ".safetensors":  # weights are LFS files on the Hub
            entry["lfs"] = {"oid": _sha256(f), "size": size, "pointerSize": 130}
        return entry

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, obj, body: bool,
              headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)


def _sha256(f: Path) -> str:
    return hashlib.sha256(f.read_bytes()).hexdigest()


def _git_oid(f: Path) -> str:
    data = f.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
