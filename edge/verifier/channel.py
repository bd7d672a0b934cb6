"""Token channel of a Generate stream: the engine's worker puts tokens, a gRPC handler reads them.

The producer never blocks (a stream holds at most max_context tokens), so a slow or
vanished reader can never hold up the worker. A coroutine reader may ask for tokens to be
held a little (`next_chunk(hold_s)`) so that several leave in one message: the worker then
wakes it at its first token put once the oldest queued token is `hold_s` old, at
`MAX_CHUNK` tokens, or at the stream's end, so a token waits at most `hold_s` plus one
decoding step. The reader is either a coroutine (`next_chunk`, woken on its event loop only while it waits) or a thread (`chunks`).
The reader cancels the channel when its caller goes away; the worker reads
`cancelled` between decoding steps and frees the stream's session.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator

MAX_CHUNK = 64  # tokens the reader takes at once when holding


class TokenChannel:
    """Thread-safe, unbounded, single-reader queue of token ids with an end (close or error)."""

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._tokens: deque[int] = deque()
        self._closed = False
        self._error: BaseException | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._hold_s = 0.0  # how long the waiting coroutine reader lets tokens gather (0: none)
        self._first_at = 0.0  # when the oldest queued token was put
        self.cancelled = False  # set by the reader; read by the worker without a lock
        self.produced = 0  # tokens put so far

    # ------------------------------------------------------------------ producer (worker)
    def put(self, token: int) -> None:
        """Hand one token to the reader."""
        with self._ready:
            if not self._tokens:
                self._first_at = time.monotonic()
            self._tokens.append(token)
            self.produced += 1
            if (
                self._hold_s
                and len(self._tokens) < MAX_CHUNK
                and time.monotonic() < self._first_at + self._hold_s
            ):
                self._ready.notify_all()  # a holding coroutine reader lets more gather
                return
            self._wake()

    def close(self) -> None:
        """End the stream normally (the reader gets what is queued, then the end)."""
        with self._ready:
            self._closed = True
            self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`, raised to the reader after what is queued."""
        with self._ready:
            if not self._closed:
                self._error, self._closed = error, True
                self._wake()

    def _wake(self) -> None:
        """Wake a waiting reader (lock held): a thread by the condition, a coroutine on its loop."""
        self._ready.notify_all()
        if self._waiter is not None:
            loop, future = self._waiter
            self._waiter, self._hold_s = None, 0.0
            with contextlib.suppress(RuntimeError):  # the reader's loop is already closed
                loop.call_soon_threadsafe(_settle, future)

    # ------------------------------------------------------------------ reader
    def cancel(self) -> None:
        """The reader is gone: the worker stops decoding this stream at its next step."""
        self.cancelled = True

    def _take(self) -> list[int] | None:
        """Queued tokens, [] when none yet, None at a normal end; raises the stream's error (lock held)."""
        if self._tokens:
            chunk = list(self._tokens)
            self._tokens.clear()
            return chunk
        if self._error is not None:
            raise self._error
        return None if self._closed else []

    async def next_chunk(self, hold_s: float = 0.0) -> list[int] | None:
        """Every token queued so far (waiting for at least one), or None at the end.

        With `hold_s` > 0 the tokens wait until the oldest of them is `hold_s` old (or
        `MAX_CHUNK` are queued, or the stream ends) and come back together.
        """
        while True:
            timer = None
            with self._ready:
                now = time.monotonic()
                held = (
                    hold_s > 0
                    and self._tokens
                    and not self._closed
                    and len(self._tokens) < MAX_CHUNK
                    and now < self._first_at + hold_s
                )
                if not held:
                    chunk = self._take()
                    if chunk != []:
                        return chunk
                loop = asyncio.get_running_loop()
                future: asyncio.Future[None] = loop.create_future()
                self._waiter, self._hold_s = (loop, future), hold_s
                if (
                    held
                ):  # tokens already wait: wake when the oldest is due, whatever the worker does
                    timer = loop.call_later(self._first_at + hold_s - now, _settle, future)
            try:
                await future
            finally:
                if timer is not None:
                    timer.cancel()
                with self._ready:
                    if self._waiter is not None and self._waiter[1] is future:
                        self._waiter, self._hold_s = None, 0.0

    def chunks(self, timeout_s: float | None = None) -> Iterator[list[int]]:
        """Blocking reader for threads: yields chunks until the end; TimeoutError after `timeout_s` idle."""
        while True:
            with self._ready:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while (chunk := self._take()) == []:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no token within {timeout_s} s")
                    self._ready.wait(left)
            if chunk is None:
                return
            yield chunk

    def __iter__(self) -> Iterator[int]:
        """Every token, blocking; ends with the stream."""
        for chunk in self.chunks():
            yield from chunk


def _settle(future: asyncio.Future[None]) -> None:
    """Wake a coroutine reader (on its loop); a reader that was cancelled meanwhile is skipped."""
    if not future.done():
        future.set_result(None)
