"""Checkpoints named as on the Hugging Face Hub (`--model ORG/NAME`), as vLLM and SGLang
take them.

`huggingface_hub` does the work and keeps its own conventions, which users of the other
servers already rely on: its cache (`HF_HOME` / `HF_HUB_CACHE`, or `<--model-cache-dir>/hub`),
`HF_TOKEN` for private and gated repositories, `HF_ENDPOINT` for a mirror, `HF_HUB_OFFLINE=1`
to read the cache only. A name resolves to a snapshot folder laid out like any local HF
folder, so everything after resolution (config check, loader, tokenizer) is shared.
Several processes resolving the same name at once (the nodes of one stack) are safe:
the hub client locks each file it downloads.
"""

from __future__ import annotations

import re
from pathlib import Path

# ORG/NAME as the Hub spells repository ids (letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a node reads from a repository; everything else (other weight formats, images,
# training state) is never downloaded.
CONFIG_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
WEIGHT_FILES = ["*.safetensors"]


class HubError(ValueError):
    """A hub name that cannot be resolved; the message says what to do."""


def is_hub_name(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "~"))


def download(repo_id: str, revision: str = "", cache_dir: str = "", weights: bool = True,
             endpoint: str | None = None) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (default: main), fetching what
    is missing. `weights=False` fetches config and tokenizer files only (a router's
    tokenizer, `--load-format dummy`); a later call with weights adds the safetensors."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as exc:  # a dependency of transformers; only a broken install lacks it
        raise HubError(f"--model {repo_id!r} names a Hub repository, which needs "
                       f"huggingface_hub: {exc}") from exc
    patterns = CONFIG_FILES + (WEIGHT_FILES if weights else [])
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision or None,
                                 cache_dir=str(Path(cache_dir) / "hub") if cache_dir else None,
                                 allow_patterns=patterns, endpoint=endpoint)
    except GatedRepoError as exc:
        raise HubError(f"model {where} is gated: accept its terms on the Hub and set "
                       f"HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(f"model {where} not found on the Hub (a private repository needs "
                       f"HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"model {where}: no such revision on the Hub") from exc
    except LocalEntryNotFoundError as exc:
        raise HubError(f"model {where} is not in the local Hub cache and the Hub cannot be "
                       f"reached (HF_HUB_OFFLINE, or no network): download it once online "
                       f"or pass a local folder") from exc
    except OSError as exc:  # disk full, permissions, a cache folder that is a file
        raise HubError(f"model {where}: {exc}") from exc
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise HubError(f"model {where} has no config.json: not a transformers checkpoint")
    if weights and not any(folder.glob("*.safetensors")):
        raise HubError(f"model {where} has no safetensors weights (pdserve reads "
                       f"safetensors only; --load-format dummy serves random weights)")
    return folder
