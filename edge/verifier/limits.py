"""Per-device rate limits: token buckets per device for verify, prefill and Generate tokens.

A device is its authenticated identity (`fedge.edge.verifier.auth`) when the server
authenticates callers; only on a server that does not is it named by the
self-asserted `fedge-device` metadata, else its bearer token (hashed), else its
peer address. Each device has one bucket per kind: a Verify costs
`len(draft_ids) + 1` verify tokens (the target positions it computes), an open
(OpenSession's `prompt_ids`, a Verify's `committed_ids`) the prefill tokens it
puts through the target, a Generate its prompt as prefill tokens (it prefills it as an
open does) and `max_new_tokens` generate tokens up front; what a stop token leaves
unused is refunded when the stream ends. Generate and prefill are metered by default
(`RateLimitConfig`'s defaults); verify only when a rate is set.
Over the limit the call ends RESOURCE_EXHAUSTED with trailing metadata
`fedge-retry-after-ms`: whole milliseconds until the bucket holds the cost.

A small bucket of our own rather than a library: `limits` offers only window
strategies, `token-bucket` has no retry-after, no refund and an unbounded key
store, `aiolimiter` has one bucket and no keys. The store here keeps at most
`max_devices` buckets (least recently used dropped), so rotating device ids
cannot grow the server's memory.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from fedge.edge.verifier.auth import CALLER
from fedge.edge.verifier.rate_config import RateLimitConfig

DEVICE_KEY = "fedge-device"  # request metadata: the device's id (asserted by the client)
RETRY_AFTER_KEY = "fedge-retry-after-ms"  # trailing metadata on a rate-limited call
VERIFY, GENERATE, PREFILL = "verify", "generate", "prefill"
BEARER = "bearer "
T = TypeVar("T")


class Buckets(Protocol):
    """One kind's buckets of every device: here (`DeviceBuckets`) or in a shared store, whose
    `take` and `refund` return awaitables (the fleet's ingresses share Redis buckets)."""

    rate: float
    burst: int

    def take(self, device: str, cost: int, debt: bool = False) -> Any: ...

    def refund(self, device: str, amount: int) -> Any: ...


async def _settled(value: T | Awaitable[T]) -> T:
    """`value`, awaited when a shared store returned an awaitable."""
    if inspect.isawaitable(value):
        return await value
    return value


class DeviceBuckets:
    """Token buckets of one rate and burst, one per device, at most `max_devices` of them."""

    def __init__(
        self, rate: float, burst: int, max_devices: int, clock: Callable[[], float]
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._max = max_devices
        self._clock = clock
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # device -> [tokens, stamp]
        self._lock = threading.Lock()

    def _refill(self, device: str, now: float) -> list[float]:
        """The device's bucket, topped up for the time since it was last touched."""
        bucket = self._buckets.get(device)
        if bucket is None:
            bucket = self._buckets[device] = [float(self.burst), now]
            if len(self._buckets) > self._max:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(device)
            bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        return bucket

    def take(self, device: str, cost: int, debt: bool = False) -> float:
        """Spend `cost` tokens: 0.0 when granted, else the seconds until they would be there.

        With `debt` a cost above the burst is granted on a full bucket, leaving it negative.
        """
        with self._lock:
            bucket = self._refill(device, self._clock())
            needed = min(cost, self.burst) if debt else cost
            if bucket[0] >= needed:
                bucket[0] -= cost
                return 0.0
            return (needed - bucket[0]) / self.rate

    def refund(self, device: str, amount: int) -> None:
        """Give back tokens a call reserved but did not use (never above the burst)."""
        with self._lock:
            bucket = self._refill(device, self._clock())
            bucket[0] = min(float(self.burst), bucket[0] + amount)

    def __len__(self) -> int:
        return len(self._buckets)


class RateLimiter:
    """The verify and generate buckets of every device."""

    def __init__(
        self,
        config: RateLimitConfig,
        clock: Callable[[], float] = time.monotonic,
        shared: Callable[[str, float, int], Buckets] | None = None,
    ) -> None:
        """`shared(kind, rate, burst)`: buckets kept elsewhere (default: in this process)."""
        self.config = config
        self.buckets: dict[str, Buckets] = {}
        for kind, rate, burst in (
            (VERIFY, config.verify_rate, config.verify_burst),
            (GENERATE, config.generate_rate, config.generate_burst),
            (PREFILL, config.prefill_rate, config.prefill_burst),
        ):
            if rate is not None:
                self.buckets[kind] = (
                    DeviceBuckets(rate, burst, config.max_devices, clock)
                    if shared is None
                    else shared(kind, rate, burst)
                )


def device_of(metadata: Sequence[tuple[str, Any]], peer: str) -> str:
    """The caller's device key: its authenticated identity; unauthenticated servers trust the
    `fedge-device` metadata, else the bearer token's hash, else the caller's host."""
    caller = CALLER.get()
    if caller is not None:
        return f"id:{caller}"
    values = {key: value for key, value in metadata}
    device = values.get(DEVICE_KEY)
    if device:
        return f"device:{device}"
    auth = str(values.get("authorization", ""))
    if auth.lower().startswith(BEARER):
        return "token:" + hashlib.sha256(auth[len(BEARER) :].encode()).hexdigest()[:16]
    return "peer:" + peer.rsplit(":", 1)[0]  # ipv4:10.0.0.7:53412 -> ipv4:10.0.0.7


def retry_after_ms(metadata: Sequence[tuple[str, Any]] | None) -> int | None:
    """The server's retry-after in milliseconds, when a RESOURCE_EXHAUSTED reply carries one."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


# --------------------------------------------------------------------------- gRPC interceptor
Handler = Callable[[Any, grpc.aio.ServicerContext], Any]


class RateLimitInterceptor(grpc.aio.ServerInterceptor):
    """Charges Verify, OpenSession and Generate to the caller's buckets; over budget they end
    RESOURCE_EXHAUSTED with a retry-after."""

    def __init__(self, limiter: RateLimiter, service: str) -> None:
        self._limiter = limiter
        self._verify = f"/{service}/Verify"
        self._open = f"/{service}/OpenSession"
        self._generate = f"/{service}/Generate"
        # method -> (the service's handler, its limited twin), built once rather than per call
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or method not in (self._verify, self._open, self._generate):
            return handler
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, self._limit(method, handler))
        return cached[1]

    def _limit(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler with its cost charged first (as is when its kinds are unlimited)."""
        buckets = self._limiter.buckets
        if method == self._generate:
            if GENERATE not in buckets and PREFILL not in buckets:
                return handler
            return grpc.unary_stream_rpc_method_handler(
                self._limited_stream(handler.unary_stream, buckets.get(GENERATE)),  # type: ignore[arg-type]
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        costs = _verify_costs if method == self._verify else _open_costs
        if not any(kind in buckets for kind, _, _ in costs(None)):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._limited_unary(handler.unary_unary, costs),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _admit(
        self, context: grpc.aio.ServicerContext, charges: list[tuple[str, int, str]]
    ) -> str:
        """Charge the caller each (kind, cost, field) or end the call; returns the device key.

        A refused call pays nothing: what an earlier kind took is given back. A prefill may
        exceed its burst (a long prompt goes through on a full bucket and leaves it in debt).
        """
        device = device_of(tuple(context.invocation_metadata() or ()), context.peer())
        taken: list[tuple[Buckets, int]] = []
        for kind, cost, field in charges:
            buckets = self._limiter.buckets.get(kind)
            if buckets is None or cost <= 0:
                continue
            if cost > buckets.burst and kind != PREFILL:
                await _refund(device, taken)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{field}: {cost} tokens exceed the per-device burst of {buckets.burst}; "
                    f"ask for at most {buckets.burst} per call",
                )
            wait_s = await _settled(buckets.take(device, cost, debt=kind == PREFILL))
            if wait_s > 0:
                await _refund(device, taken)
                wait_ms = math.ceil(wait_s * 1000)
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"rate limit: {cost} {kind} tokens over this device's budget of "
                    f"{buckets.rate:g}/s (burst {buckets.burst}); retry after {wait_ms} ms",
                    trailing_metadata=((RETRY_AFTER_KEY, str(wait_ms)),),
                )
            taken.append((buckets, cost))
        return device

    def _limited_unary(
        self, behavior: Handler, costs: Callable[[Any], list[tuple[str, int, str]]]
    ) -> Handler:
        """A Verify or OpenSession that first pays its costs."""

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._admit(context, costs(request))
            return await behavior(request, context)

        return limited

    def _limited_stream(
        self,
        behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]],
        buckets: Buckets | None,
    ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
        """A Generate that pays its prompt as prefill, reserves `max_new_tokens` and refunds
        the tokens it did not stream (counted per token: a reply may carry several)."""

        async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            cost = max(1, int(request.max_new_tokens))
            device = await self._admit(context, _generate_costs(request))
            sent = 0
            try:
                async for reply in behavior(request, context):
                    sent += 1 + len(reply.more_token_ids)  # tokens, not replies (batch_tokens)
                    yield reply
            finally:
                if sent < cost and buckets is not None:
                    await _settled(buckets.refund(device, cost - sent))

        return generate


def _verify_costs(request: Any) -> list[tuple[str, int, str]]:
    """A Verify: `len(draft_ids) + 1` verify tokens, plus the committed tokens it would prefill."""
    if request is None:
        return [(VERIFY, 0, ""), (PREFILL, 0, "")]
    return [
        (VERIFY, len(request.draft_ids) + 1, "draft_ids"),
        (PREFILL, len(request.committed_ids), "committed_ids"),
    ]


def _generate_costs(request: Any) -> list[tuple[str, int, str]]:
    """A Generate: the prompt it prefills, then `max_new_tokens` generate tokens."""
    return [
        (PREFILL, len(request.prompt_ids), "prompt_ids"),
        (GENERATE, max(1, int(request.max_new_tokens)), "max_new_tokens"),
    ]


def _open_costs(request: Any) -> list[tuple[str, int, str]]:
    """An OpenSession: the prompt tokens it prefills."""
    if request is None:
        return [(PREFILL, 0, "")]
    return [(PREFILL, len(request.prompt_ids), "prompt_ids")]


async def _refund(device: str, taken: list[tuple[Buckets, int]]) -> None:
    """Give back what a refused call had been charged."""
    for buckets, cost in taken:
        await _settled(buckets.refund(device, cost))
