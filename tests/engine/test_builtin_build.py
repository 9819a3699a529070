"""Built-in models are built once per cache, even when every node of a stack starts at the
same moment on a fresh machine: the others wait for the builder and then read its folder.
Before the build lock, a late builder moved a finished folder aside (taking it for an
outdated build) while another node was reading its tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdserve.models.builtin import resolve_model

CHILD = """
import json, os, sys
from pathlib import Path
from transformers import AutoTokenizer
from pdserve.models.builtin import resolve_model
path = resolve_model("tiny-llama", cache_dir=sys.argv[1], tokenizer_dir=Path(sys.argv[2]))
ino = os.stat(path).st_ino
AutoTokenizer.from_pretrained(path)  # the folder must still be whole after the others
print(json.dumps({"ino": ino, "ino_after": os.stat(path).st_ino}))
"""


def test_concurrent_first_builds_share_one_folder(tmp_path: Path):
    tok_dir = resolve_model("smollm2-135m")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(tok_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    inodes = {(r["ino"], r["ino_after"]) for r in (json.loads(o) for o, _ in outs)}
    assert len(inodes) == 1 and len({*next(iter(inodes))}) == 1, inodes  # built once
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp" in p.name or ".old" in p.name]
    assert leftovers == []
    assert (tmp_path / "tiny-llama" / "config.json").exists()
