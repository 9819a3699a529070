"""The docs say only what the repository holds: README.md, docs/*.md and tests/README.md.

- links: every relative markdown link names an existing file, and a `#anchor` names a
  heading of its target (GitHub's slug rules);
- paths: every repo path in backticks (a top-level folder followed by `/`, or a top-level
  file) and every such path in a fenced shell block exists; `:section` and `::test`
  suffixes are cut off, paths with glob or brace characters are skipped;
- flags: every `--flag` of a `pdserve <subcommand> ...` command (fenced blocks and inline
  code) is listed by that subcommand's `--help` (and its sub-subcommand's, e.g.
  `pdserve bench compare`);
- shell: every ```bash / ```sh block parses with `bash -n`;
- citations: every `docs/architecture.md: <Section>` in the code names a heading there.

Each finding names the file and line. The `test_check_*` tests feed each checker a wrong
document, so a checker that can no longer fail is caught too.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("pdserve", "tests", "bench", "scripts", "helm", "docs", "kv_transfer",
               "bootstrap", "prefill_node", "decode_node", "docker", ".ci")
# Written by the commands the docs show (git-ignored), so absent from a clean checkout.
GENERATED = ("bench/out/",)
GLOB_CHARS = set("*?[]{}<>…$")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
README_MAX_LINES = 200


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md"]


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


# --- markdown parsing -------------------------------------------------------------------

@dataclass
class Block:
    lang: str
    start: int  # 1-based line number of the first line inside the fence
    lines: list[str]


@dataclass
class Doc:
    path: Path
    blocks: list[Block]
    prose: str  # the text with every fenced line blanked (line numbers kept)

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1


FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


def parse(path: Path, text: str | None = None) -> Doc:
    text = path.read_text() if text is None else text
    blocks: list[Block] = []
    prose: list[str] = []
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            blocks.append(Block(m.group(2).lower(), n + 1, []))
            prose.append("")
        elif fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            else:
                blocks[-1].lines.append(line)
            prose.append("")
        else:
            prose.append(line)
    return Doc(path, blocks, "\n".join(prose))


CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def code_spans(doc: Doc) -> list[tuple[int, str]]:
    """(line, content) of every inline code span outside fenced blocks."""
    out = []
    for m in CODE_SPAN.finditer(doc.prose):
        if "\n\n" not in m.group(2):
            out.append((doc.line_of(m.start()), " ".join(m.group(2).split())))
    return out


def without_code(doc: Doc) -> str:
    """The prose with code spans blanked (same length, so offsets keep their lines)."""
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), doc.prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in parse(path).prose.split("\n"):
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


# --- (a) links --------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)


def check_links(doc: Doc) -> list[str]:
    problems = []
    text = without_code(doc)
    targets = [(m.start(1), m.group(1)) for m in LINK.finditer(text)]
    targets += [(m.start(1), m.group(1)) for m in REF_DEF.finditer(text)]
    for offset, target in targets:
        where = f"{rel(doc.path)}:{doc.line_of(offset)}"
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto: ...
        path_part, _, anchor = target.partition("#")
        if path_part.startswith("/"):
            problems.append(f"{where}: absolute link {target!r} (use a relative path)")
            continue
        dest = (doc.path.parent / path_part).resolve() if path_part else doc.path
        if not dest.exists():
            problems.append(f"{where}: link {target!r}: {rel(dest)} does not exist")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{where}: link {target!r}: an anchor into a non-markdown file")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: link {target!r}: no heading #{anchor} in {rel(dest)}")
    return problems


# --- (b) paths --------------------------------------------------------------------------

TOP_FILE = re.compile(r"^(?:[\w.-]+\.(?:md|toml)|LICENSE|Dockerfile)$")


def repo_path(word: str) -> str | None:
    """The repo path a word names, or None when it names none (or one with globs)."""
    word = word.strip().strip("'\"").rstrip(".,;)")
    word = word.split("::")[0]
    word = re.sub(r":.*$", "", word)  # `file.py: Class`, `file.py:123`
    if not word or GLOB_CHARS & set(word):
        return None
    if "/" in word:
        if not word.startswith(tuple(f"{f}/" for f in TOP_FOLDERS)):
            return None
        return word
    return word if TOP_FILE.match(word) else None


def check_paths(doc: Doc, root: Path = REPO) -> list[str]:
    problems = []

    def check(line: int, word: str) -> None:
        path = repo_path(word)
        if path and not path.startswith(GENERATED) and not (root / path).exists():
            problems.append(f"{rel(doc.path)}:{line}: path {path!r} does not exist")

    for line, span in code_spans(doc):
        words = span.split()
        for i, word in enumerate(words):
            # The first word may be a top-level file; later ones count only as folder paths.
            if i == 0 or word.startswith(tuple(f"{f}/" for f in TOP_FOLDERS)):
                check(line, word)
    for block in doc.blocks:
        if block.lang not in SHELL_LANGS:
            continue
        for i, text in enumerate(block.lines):
            code = text.split(" #")[0] if not text.lstrip().startswith("#") else ""
            for word in code.split():
                if word.startswith(tuple(f"{f}/" for f in TOP_FOLDERS)):
                    check(block.start + i, word)
    return problems


# --- (c) pdserve flags ------------------------------------------------------------------

@functools.cache
def help_text(*command: str) -> str:
    env = {**os.environ, "COLUMNS": "1000"}  # no wrapping: one option per line
    res = subprocess.run([sys.executable, "-m", "pdserve.cli", *command, "--help"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"pdserve {' '.join(command)} --help failed:\n{res.stderr}"
    return res.stdout


def help_flags(*command: str) -> set[str]:
    """The option strings `--help` lists (the invocation column only, not the prose)."""
    flags = set()
    for line in help_text(*command).splitlines():
        if line.lstrip().startswith("-"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags |= set(re.findall(r"--[\w-]+", invocation))
    return flags


def sub_commands(*command: str) -> set[str]:
    """Subcommand names of `pdserve [command]` (from its usage: `{a,b} ...` or `COMMAND`)."""
    text = help_text(*command)
    if not command:
        return set(re.findall(r"^    (\w[\w-]*)\s", text, re.M))
    m = re.search(r"\{([\w,-]+)\} \.\.\.", text)
    return set(m.group(1).split(",")) if m else set()


def commands_in(text: str) -> list[list[str]]:
    """The `pdserve ...` commands of one shell line (after `&&`, `;`, `|`, `&` too)."""
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        tokens = list(lex)
    except ValueError:
        tokens = text.split()
    commands, current = [], []
    for tok in [*tokens, ";"]:
        if tok and set(tok) <= set("&|;()<>"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(tok)
    out = []
    for cmd in commands:
        while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
            cmd = cmd[1:]  # FOO=bar pdserve ...
        if cmd and (cmd[0] == "pdserve" or cmd[0].endswith("/pdserve")):
            out.append(cmd[1:])
    return out


def flag_problems(args: list[str]) -> list[str]:
    """What is wrong with `pdserve ARGS` against the --help of its (sub)subcommand."""
    command: list[str] = []
    rest = list(args)
    if rest and not rest[0].startswith("-"):
        for alt in rest[0].split("|"):  # `pdserve prefill|decode`
            if alt not in sub_commands():
                return [f"unknown subcommand `pdserve {alt}`"]
        command = [rest.pop(0)]
    if rest and command and rest[0] in sub_commands(command[0].split("|")[0]):
        command.append(rest.pop(0))
    problems = []
    skip_next = False
    for tok in rest:
        if skip_next:  # the value of --node-args / --router-args: another command's flags
            skip_next = False
            continue
        m = re.match(r"^(--[A-Za-z0-9][\w-]*)(=.*)?$", tok)
        if not m:
            continue
        flag = m.group(1)
        skip_next = flag.endswith("-args") and not m.group(2)
        for alt in (command[0].split("|") if command else [""]):
            cmd = [c for c in [alt, *command[1:]] if c]
            if flag not in help_flags(*cmd):
                problems.append(f"`pdserve {' '.join(cmd)}` has no {flag}")
    return problems


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """Lines of a block with backslash continuations joined, with their first line."""
    out, buf, first = [], "", 0
    for i, line in enumerate(block.lines):
        if not buf:
            first = block.start + i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
        else:
            out.append((first, buf + line))
            buf = ""
    if buf:
        out.append((first, buf))
    return out


def check_flags(doc: Doc) -> list[str]:
    problems = []
    for block in doc.blocks:
        if block.lang not in SHELL_LANGS | {""}:
            continue
        for line, text in logical_lines(block):
            for args in commands_in(text):
                problems += [f"{rel(doc.path)}:{line}: {p}" for p in flag_problems(args)]
    for line, span in code_spans(doc):
        if re.match(r"^(\.venv/bin/)?pdserve \w", span):
            # Quoted values (--node-args '--tp-size 2') belong to another command.
            words = re.sub(r"'[^']*'|\"[^\"]*\"", "''", span).split()[1:]
            words = [w for w in words if w.strip("[]")]
            words = [w.strip("[]") if w.startswith("[") or w.endswith("]") else w for w in words]
            problems += [f"{rel(doc.path)}:{line}: {p}" for p in flag_problems(words)]
    return problems


# --- (d) shell blocks -------------------------------------------------------------------

def check_shell(doc: Doc) -> list[str]:
    problems = []
    for block in doc.blocks:
        if block.lang not in {"bash", "sh"}:
            continue
        res = subprocess.run(["bash", "-n"], input="\n".join(block.lines) + "\n",
                             capture_output=True, text=True)
        if res.returncode != 0:
            m = re.search(r"line (\d+)", res.stderr)
            line = block.start + int(m.group(1)) - 1 if m else block.start
            msg = res.stderr.strip().splitlines()[0] if res.stderr.strip() else "bash -n failed"
            problems.append(f"{rel(doc.path)}:{line}: bash -n: {msg}")
    return problems


# --- the docs ---------------------------------------------------------------------------

DOCS = [pytest.param(p, id=rel(p)) for p in doc_files()]


def _report(problems: list[str]) -> None:
    assert not problems, "\n" + "\n".join(problems)


def test_docs_exist():
    for path in doc_files():
        assert path.is_file(), f"{rel(path)} is missing"
    assert len(doc_files()) > 3


@pytest.mark.parametrize("path", DOCS)
def test_links_resolve(path):
    _report(check_links(parse(path)))


@pytest.mark.parametrize("path", DOCS)
def test_paths_exist(path):
    _report(check_paths(parse(path)))


@pytest.mark.parametrize("path", DOCS)
def test_pdserve_flags_exist(path):
    _report(check_flags(parse(path)))


@pytest.mark.parametrize("path", DOCS)
def test_shell_blocks_parse(path):
    _report(check_shell(parse(path)))


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


CITATION = re.compile(r"docs/architecture\.md(?:[ \t]*[:,][ \t]*|[ \t]*\([ \t]*)(.{0,120})", re.S)


def architecture_citations() -> list[tuple[str, int, str]]:
    """(file, line, cited text) of every `docs/architecture.md: <Section>` in the code."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in files:
        if name.startswith("docs/") or name.endswith((".md", ".json", ".png", ".whl")):
            continue
        path = REPO / name
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for m in CITATION.finditer(text):
            # Join comment and docstring lines: drop the leaders (#, //, *) after newlines.
            cited = re.sub(r"\n\s*(?:#+|//|\*+|\"\"\")?\s*", " ", m.group(1))
            cited = cited.lstrip("\"'` ")
            if cited[:1].isalpha():
                out.append((name, text.count("\n", 0, m.start()) + 1, cited))
    return out


def cites_a_heading(cited: str, headings: set[str]) -> bool:
    low = cited.lower()
    return any(low.startswith(h.lower()) and not low[len(h):len(h) + 1].isalnum()
               for h in headings)


def architecture_headings() -> set[str]:
    text = parse(REPO / "docs" / "architecture.md").prose
    return {m.group(1).replace("`", "") for m in re.finditer(r"^#{2,3}\s+(.*?)\s*$", text, re.M)}


def test_code_citations_name_architecture_headings():
    headings = architecture_headings()
    citations = architecture_citations()
    assert len(citations) > 50, "the citation scan found almost nothing: is the regex broken?"
    _report([f"{name}:{line}: cites docs/architecture.md: {cited[:40]!r}, no such heading"
             for name, line, cited in citations if not cites_a_heading(cited, headings)])


# --- each checker can fail --------------------------------------------------------------

def _doc(tmp_path: Path, text: str, name: str = "page.md") -> Doc:
    path = tmp_path / name
    path.write_text(text)
    return parse(path)


def test_check_links_catches_missing_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## Behind SGLang's router\n\n## Title\n")
    doc = _doc(tmp_path, "\n".join([
        "[ok](other.md) [ok](other.md#behind-sglangs-router) [ok](other.md#title-1)",
        "[ok](#local) [ok](https://example.com/x) `[not a link](nowhere.md)`",
        "[missing](nowhere.md)",
        "[bad anchor](other.md#no-such-heading)",
        "```", "[in a fence](fenced.md)", "```",
        "## Local",
        "[bad local](#elsewhere)",
    ]))
    problems = check_links(doc)
    assert len(problems) == 3, problems
    assert "page.md:3:" in problems[0] and "nowhere.md" in problems[0]
    assert "page.md:4:" in problems[1] and "#no-such-heading" in problems[1]
    assert "page.md:9:" in problems[2] and "#elsewhere" in problems[2]


def test_slug_follows_github():
    assert slug("Behind SGLang's router") == "behind-sglangs-router"
    assert slug("Router (gateway)") == "router-gateway"
    assert slug("`pdserve/` packages") == "pdserve-packages"
    assert slug("Staging buffers and the write-after-read guard") == \
        "staging-buffers-and-the-write-after-read-guard"


def test_check_paths_catches_missing_paths(tmp_path):
    doc = _doc(tmp_path, "\n".join([
        "`pdserve/engine/scheduler.py: Scheduler` `tests/helm/test_image.py::test_x`",
        "`pdserve/no_such_file.py`",
        "`bench/results/forward-*` `bench/out/x.json` `not/a/repo/path` `NOSUCH.md`",
        "```bash",
        "bash scripts/setup.sh",
        "bash scripts/nope.sh  # comment with scripts/also_nope.sh",
        "```",
    ]))
    problems = check_paths(doc)
    assert len(problems) == 3, problems
    assert "page.md:2:" in problems[0] and "pdserve/no_such_file.py" in problems[0]
    assert "page.md:3:" in problems[1] and "NOSUCH.md" in problems[1]
    assert "page.md:6:" in problems[2] and "scripts/nope.sh" in problems[2]


def test_check_flags_catches_unknown_flags_and_subcommands(tmp_path):
    doc = _doc(tmp_path, "\n".join([
        "`pdserve serve --no-such-flag` `pdserve up --node-args '--tp-size 2'`",
        "```bash",
        "pdserve serve --model tiny-llama --port 30000",
        ".venv/bin/pdserve up --model m \\",
        "    --router-args '--x' --no-such-up-flag",
        "bash scripts/setup.sh && .venv/bin/pdserve demo --prefil 1",
        "pdserve bench compare a.jsonl --plot x.png --label y",
        "pdserve nosuchcommand --x",
        "```",
    ]))
    problems = check_flags(doc)
    assert len(problems) == 5, problems
    text = "\n".join(problems)
    assert "page.md:1: `pdserve serve` has no --no-such-flag" in text
    assert "page.md:4: `pdserve up` has no --no-such-up-flag" in text
    assert "page.md:6: `pdserve demo` has no --prefil" in text
    assert "page.md:7: `pdserve bench compare` has no --label" in text
    assert "page.md:8: unknown subcommand `pdserve nosuchcommand`" in text


def test_check_shell_catches_syntax_errors(tmp_path):
    doc = _doc(tmp_path, "\n".join([
        "```bash", "echo ok", "```",
        "```sh", "echo ok", "if true; then", "  echo 'unterminated", "```",
        "```python", "if (:", "```",
    ]))
    problems = check_shell(doc)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{rel(doc.path)}:") and "bash -n" in problems[0]


def test_citation_check_can_fail():
    headings = {"Memory", "Tensor parallelism", "CUDA graphs"}
    assert cites_a_heading("Tensor parallelism, \"P TP != D TP\").", headings)
    assert cites_a_heading("memory)", headings)
    assert not cites_a_heading("Planned work)", headings)
    assert not cites_a_heading("Memoryless", headings)
