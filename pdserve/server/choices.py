"""`n > 1`: the event streams of a request's n choices, run side by side and interleaved
(docs/architecture.md: Logprobs). Each choice is an ordinary request of its own (the node
batches them; seeds differ per choice, see `protocol._OpenAICommon.choice_seed`).

`merge` yields `(index, event)` pairs and ends with the first `ApiError` any choice
raises or yields; leaving it early (client gone, error) cancels every choice's task, and
each stream's own cleanup (abort, KV release) runs then.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.server.protocol import ApiError

_END = object()


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    if len(streams) == 1:  # the common case: no tasks, no queue
        async for ev in streams[0]:
            yield ev if isinstance(ev, ApiError) else (0, ev)
            if isinstance(ev, ApiError):
                return
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
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


async def last_events(streams: list[AsyncIterator]) -> list:
    """The final event of every choice (non-streaming answers). Raises the first ApiError;
    None in the list: that choice produced nothing (the client went away)."""
    last: list = [None] * len(streams)
    async for item in merge(streams):
        if isinstance(item, ApiError):
            raise item
        i, ev = item
        last[i] = ev
    return last
