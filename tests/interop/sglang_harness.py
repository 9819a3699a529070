"""The real SGLang router (`sglang-router` from PyPI: a Rust binary in the wheel) in front of
real pdserve prefill/decode nodes, all on loopback (docs/architecture.md: Interfaces,
"Behind SGLang's router"). Node processes come from tests/pd/pd_procs.py.

Our servers bind port 0 and report theirs (the HTTP port in a --port-file, a prefill
node's bootstrap endpoint in /server_info); SGLang's router cannot, so its own ports are
picked free just before it starts, and the start is retried on another port if something
took it meanwhile.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pd"))
from pd_procs import Node, Proc, Registry, free_port, wait_for_port  # noqa: E402

SGLANG_ROUTER_VERSION = "0.3.2"  # the version this interop is proven with (pyproject test extra)
MODEL = "tiny-llama"
KV_FLAGS = ["--kv-heartbeat-interval-s", "0.5", "--kv-heartbeat-misses", "4",  # 2 s
            "--kv-transfer-timeout-s", "10", "--kv-bootstrap-timeout-s", "6"]
PREFILL_FLAGS = ["--max-total-tokens", "8192", "--chunked-prefill-size", "32",
                 "--max-prefill-tokens", "64", "--disaggregation-bootstrap-port", "0",
                 *KV_FLAGS]
DECODE_FLAGS = ["--max-total-tokens", "4096", *KV_FLAGS]


def router_version() -> str:
    from importlib.metadata import version

    return version("sglang-router")


class SGLangRouter(Proc):
    """`python -m sglang_router.launch_router --pd-disaggregation --prefill URL PORT ...`"""

    def __init__(self, prefills: list[Node], decodes: list[Node], log_dir: Path,
                 flags: list[str] = ()) -> None:
        self.prefills, self.decodes, self.flags = prefills, decodes, list(flags)
        self.url = ""
        super().__init__("sglang-router", [], log_dir)

    def command(self, port: int) -> list[str]:
        # free_port: SGLang's router (not our server) reports no port it bound itself.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--log-level", "info"]
        for p in self.prefills:
            cmd += ["--prefill", p.url, str(p.info()["disaggregation_bootstrap_port"])]
        for d in self.decodes:
            cmd += ["--decode", d.url]
        return cmd + self.flags

    def start(self, timeout: float = 90, tries: int = 3) -> SGLangRouter:
        for _ in range(tries):
            port = free_port()  # see command(): a race, hence the retries
            self.cmd = self.command(port)
            self.url = f"http://127.0.0.1:{port}"
            self.spawn()
            if self._wait_workers(timeout):
                return self
            if self.alive:  # up but the workers never became usable: not a port race
                break
            self.stop()
        log = self.log()
        self.stop()
        raise RuntimeError(f"sglang-router not ready:\n{log}")

    def _wait_workers(self, timeout: float) -> bool:
        """Until the router serves and counts every worker as registered."""
        want = len(self.prefills) + len(self.decodes)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive:
            try:
                info = httpx.get(f"{self.url}/get_server_info", timeout=2).json()
                models = httpx.get(f"{self.url}/v1/models", timeout=2).json()
                if info.get("workers_count") == want and \
                        [m["id"] for m in models.get("data", [])] == [MODEL]:
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        return False


# -- client side ------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int | None = None
    body: dict | None = None
    chunks: list = field(default_factory=list)  # parsed SSE objects, "[DONE]" kept
    error: str | None = None  # transport error
    raw: str = ""
    t_end: float = 0.0

    @property
    def stream_text(self) -> str:
        """Concatenated text of an OpenAI or /generate stream."""
        out = ""
        for c in self.chunks:
            if c == "[DONE]" or "choices" not in c:
                continue
            ch = c["choices"][0]
            out += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
        return out

    @property
    def stream_error(self) -> bool:
        return any(c != "[DONE]" and "error" in c for c in self.chunks)


def post(url: str, path: str, body: dict, timeout: float = 120) -> Reply:
    res = Reply()
    try:
        if body.get("stream"):
            with httpx.stream("POST", url + path, json=body, timeout=timeout) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    res.raw = r.read().decode(errors="replace")
                else:
                    for line in r.iter_lines():
                        res.raw += line + "\n"
                        if line.startswith("data: "):
                            data = line[len("data: "):]
                            res.chunks.append(data if data == "[DONE]" else json.loads(data))
        else:
            r = httpx.post(url + path, json=body, timeout=timeout)
            res.status, res.raw = r.status_code, r.text
            res.body = _json_or_none(r.text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.t_end = time.monotonic()
    return res


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


__all__ = ["DECODE_FLAGS", "MODEL", "Node", "PREFILL_FLAGS", "Proc", "Registry",
           "SGLangRouter", "free_port", "post", "router_version", "wait_for_port"]
