"""The streaming response of every pdserve server: Starlette's, plus a close of its body
generator however the response ends.

Starlette abandons the body generator when the client leaves while the response waits on
the socket: the generator stays suspended at its `yield`, and its cleanup (the node's abort
of the request, which frees its KV pages) runs only when the garbage collector finalizes
it, seconds or minutes later when it sits in a reference cycle. Closing it here runs that
cleanup as soon as the response ends; the generators below it close their own inputs
(`contextlib.aclosing`), so the close reaches the request.
"""

from __future__ import annotations

from starlette.responses import StreamingResponse


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
