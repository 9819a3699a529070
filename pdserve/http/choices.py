"""`n > 1` or several prompts: the event streams of a request's choices, run side by side
and interleaved (docs/architecture.md: Logprobs). Each choice is an ordinary request of
its own (the node batches them; seeds differ per choice, see
`protocol._OpenAICommon.choice_seed`).

`merge` yields `(index, event)` pairs and ends with the first `ApiError` any choice
raises or yields; leaving it early (client gone, error) cancels every choice's task, and
each stream's own cleanup (abort, KV release) runs then.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from pdserve.http.errors import ApiError

_END = object()


async def start_all(streams: list[AsyncGenerator], started,
                    leaders: list[int] | None = None) -> list[AsyncGenerator]:
    """Start the `leaders` (default: choice 0; with several prompts, each prompt's first
    choice) together and wait for their first events (their prompts are computed and,
    asked with `cache_prompt`, in the prefix cache), then the others together: they reuse
    their leader's prompt pages instead of each computing the prompt. `started` pulls a
    stream's first event (admission errors stay HTTP statuses); on any failure every
    started choice is closed."""
    leaders = [0] if leaders is None else leaders
    rest = sorted(set(range(len(streams))) - set(leaders))
    out: list = [None] * len(streams)
    for wave in (leaders, rest):
        tasks = [asyncio.ensure_future(started(streams[i])) for i in wave]
        try:
            for i, s in zip(wave, await asyncio.gather(*tasks), strict=True):
                out[i] = s
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ok = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
            for s in [s for s in out if s is not None] + ok:
                await s.aclose()
            raise
    return out


async def merge(streams: list[AsyncGenerator]) -> AsyncGenerator:
    if len(streams) == 1:  # the common case: no tasks, no queue
        async with aclosing(streams[0]) as stream:
            async for ev in stream:
                yield ev if isinstance(ev, ApiError) else (0, ev)
                if isinstance(ev, ApiError):
                    return
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator) -> None:
        try:
            async with aclosing(stream):
                async for ev in stream:
                    await queue.put(ev if isinstance(ev, ApiError) else (i, ev))
        except ApiError as exc:
            await queue.put(exc)
        except Exception as exc:  # a bug in one choice still ends the answer cleanly
            await queue.put(ApiError(500, f"choice {i} failed: {type(exc).__name__}: {exc}"))
        finally:
            await queue.put(_END)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is _END:
                live -= 1
                continue
            yield item
            if isinstance(item, ApiError):
                return
    finally:
        for t in tasks:
            t.cancel()


async def last_events(streams: list[AsyncGenerator]) -> list:
    """The final event of every choice (non-streaming answers). Raises the first ApiError;
    None in the list: that choice produced nothing (the client went away)."""
    last: list = [None] * len(streams)
    async for item in merge(streams):
        if isinstance(item, ApiError):
            raise item
        i, ev = item
        last[i] = ev
    return last
