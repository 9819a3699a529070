"""Logprobs on the wire (docs/architecture.md: Logprobs): the engine's entries turned into
SGLang's `/generate` meta fields, OpenAI's completions and chat `logprobs` objects, and
back from SGLang's fields (the router reads a node's /generate stream).

An *entry* is the engine's `(logprob, [(alternative id, logprob), ...])` for one token,
or None where a value is unknown (a PD decode node's first token: the router puts the
prefill node's entry there).
"""

from __future__ import annotations

from collections.abc import Sequence

Entry = tuple[float, list[tuple[int, float]]] | None


class TokenText:
    """Text of single tokens, cached (OpenAI reports each token as its own decoded text)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self.tokenizer.decode([tid])
        return s


# -- SGLang /generate -------------------------------------------------------------------


def _triple(lp, tid: int) -> list:
    return [lp, tid, None]  # (logprob, token id, token text: not asked for)


def sglang_meta(output_ids: Sequence[int], out: Sequence[Entry] | None,
                prompt_ids: Sequence[int], prompt: Sequence[Entry] | None,
                start_len: int) -> dict:
    """SGLang's meta_info logprob fields. `prompt` has entries for prompt tokens 1..;
    `start_len` < 0 means no input logprobs (SGLang's `logprob_start_len`)."""
    meta = {"output_token_logprobs": [
        _triple(e[0] if e else None, t) for t, e in zip(output_ids, out or (), strict=False)],
        "output_top_logprobs": [
            [_triple(lp, a) for a, lp in e[1]] if e else None for e in (out or ())]}
    inp_tok, inp_top = [], []
    if start_len >= 0 and prompt is not None:
        for i in range(start_len, len(prompt_ids)):
            e = prompt[i - 1] if 0 < i <= len(prompt) else None
            inp_tok.append(_triple(e[0] if e else None, prompt_ids[i]))
            inp_top.append([_triple(lp, a) for a, lp in e[1]] if e else None)
    meta["input_token_logprobs"], meta["input_top_logprobs"] = inp_tok, inp_top
    return meta


def _entries(tokens: list, tops: list) -> list[Entry]:
    out: list[Entry] = []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) else None
        if tok[0] is None:
            out.append(None)
        else:
            out.append((tok[0], [(a[1], a[0]) for a in top or ()]))
    return out


def output_entries(meta: dict) -> list[Entry] | None:
    """The engine's output entries from a node's SGLang meta (None if it has none)."""
    if "output_token_logprobs" not in meta:
        return None
    return _entries(meta["output_token_logprobs"], meta.get("output_top_logprobs") or [])


def prompt_entries(meta: dict) -> list[Entry] | None:
    """Prompt entries (tokens 1..) from SGLang input fields asked with logprob_start_len 0."""
    tokens = meta.get("input_token_logprobs")
    if not tokens:
        return None
    return _entries(tokens, meta.get("input_top_logprobs") or [])[1:]


def merge_prefill(decode_meta: dict, prefill_meta: dict) -> dict:
    """A PD answer: the decode node's output logprobs with the first token's entry and the
    input logprobs from the prefill node, which computed them (docs/architecture.md: Logprobs)."""
    out = dict(decode_meta)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        first = prefill_meta.get(key) or []
        if first and out.get(key):
            out[key] = first[:1] + list(out[key][1:])
    for key in ("input_token_logprobs", "input_top_logprobs"):
        out[key] = prefill_meta.get(key) or []
    return out


# -- OpenAI ----------------------------------------------------------------------------


def completion_logprobs(text: TokenText, ids: Sequence[int], entries: Sequence[Entry],
                        offset: int) -> dict:
    """Legacy completions `logprobs` of `ids` whose text starts at character `offset`. A
    token without an entry (the first prompt token under echo) has null logprobs."""
    obj: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                            "top_logprobs": []}
    for tid, e in zip(ids, entries, strict=True):
        s = text(tid)
        obj["tokens"].append(s)
        obj["text_offset"].append(offset)
        offset += len(s)
        if e is None:
            obj["token_logprobs"].append(None)
            obj["top_logprobs"].append(None)
            continue
        obj["token_logprobs"].append(e[0])
        top = {text(a): lp for a, lp in e[1]}
        top.setdefault(s, e[0])  # vLLM: the chosen token is always listed
        obj["top_logprobs"].append(top)
    return obj


def _chat_token(s: str, lp: float) -> dict:
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(text: TokenText, ids: Sequence[int], entries: Sequence[Entry]) -> dict:
    content = []
    for tid, e in zip(ids, entries, strict=True):
        lp, top = e if e is not None else (-9999.0, [])  # vLLM's stand-in for -inf
        content.append({**_chat_token(text(tid), lp),
                        "top_logprobs": [_chat_token(text(a), alp) for a, alp in top]})
    return {"content": content, "refusal": None}
