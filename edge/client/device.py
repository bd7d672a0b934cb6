"""The device side as a library: per request, route, decode, fall back, report, and teach the router."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from fedge.edge.client.config import RateLimited, VerifierUnreachable
from fedge.edge.client.fallback import finish_on_device
from fedge.edge.client.report import RequestReport
from fedge.edge.client.routes import decode_on_route
from fedge.edge.client.verifier import TRANSIENT, VerifierClient
from fedge.edge.decoder import DecodeConfig
from fedge.edge.router import Objective, Route, Router
from fedge.edge.tracing import REQUEST_SPAN, Tracing
from fedge.lm.bos import bos_token_id, with_bos


class EdgeClient:
    """Tokenizer, draft runtime, verifier link and offload router, one request at a time.

    `stream_text(prompt)` yields text pieces as tokens are accepted; each request's route comes
    from the router (or is forced), and its outcome feeds the router. A request the verifier
    rate-limits (`RateLimited`) before its first token is decoded on the device instead, and the
    cloud routes are skipped until the verifier's retry-after has passed. A request whose
    verifier is lost mid-way is finished on the device (`fallback`); the next request checks
    health again and returns to the verifier when it is SERVING.
    """

    def __init__(
        self,
        runtime: Any,
        tokenizer: Any,
        verifier: VerifierClient | None,
        decode: DecodeConfig,
        router: Router | None = None,
        objective: Objective | None = None,
        rtt_max_age_s: float = 5.0,  # a health-check ping is reused this long: it costs an RTT
    ) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.verifier = verifier
        self.decode = decode
        self.router = router or Router()
        self.objective = objective or Objective()
        self.rtt_max_age_s = rtt_max_age_s
        self.last: RequestReport | None = None
        self._up = False  # the verifier answered SERVING since it was last lost
        self._cloud_after = 0.0  # monotonic time before which the verifier asked us to stay away
        if verifier is None:
            self.router.verifier_down()

    def stream_ids(
        self, prompt_ids: Sequence[int], route: str | None = None
    ) -> Iterator[list[int]]:
        """Yield generated token chunks on the chosen (or forced) route, as one traced request."""
        tracing = self.verifier.tracing if self.verifier is not None else Tracing(None)
        return tracing.iterate(
            REQUEST_SPAN,
            self._request(prompt_ids, route),
            self._describe,
            prompt_tokens=len(prompt_ids),
        )

    def stream_text(self, prompt: str, route: str | None = None) -> Iterator[str]:
        """Yield decoded text pieces as tokens arrive."""
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if prompt_ids:  # BOS first where the tokenizer adds BOS (fedge.lm.bos)
            prompt_ids = with_bos(prompt_ids, bos_token_id(self.tokenizer))
        if not prompt_ids:
            raise ValueError("prompt encodes to no tokens; pass some text")
        generated: list[int] = []
        shown = ""
        for chunk in self.stream_ids(prompt_ids, route):
            generated.extend(chunk)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown) :]
                shown = text

    def _describe(self, span: Any) -> None:
        """Put the request report on its span."""
        if self.last is not None:
            for key, value in vars(self.last).items():
                span.set_attribute(f"fedge.{key}", value)

    def _request(self, prompt_ids: Sequence[int], forced: str | None) -> Iterator[list[int]]:
        """One request: route, decode, fall back, then report (all round trips, pings included)."""
        verifier = self.verifier
        calls0, one_way0, up0, down0, overloads0 = (
            (
                verifier.calls,
                verifier.one_way,
                verifier.bytes_up,
                verifier.bytes_down,
                verifier.overloads,
            )
            if verifier
            else (0, 0, 0, 0, 0)
        )
        started = time.perf_counter()
        rtt = self.measure_rtt()
        route, reason = self._route(forced)
        report = self.last = RequestReport(route.value, reason)
        produced: list[int] = []

        def counted(chunks: Iterator[list[int]]) -> Iterator[list[int]]:
            for chunk in chunks:
                if not report.tokens:
                    report.ttft_s = time.perf_counter() - started
                report.tokens += len(chunk)
                produced.extend(chunk)
                yield chunk

        try:
            yield from counted(self._on_route(route, prompt_ids, report))
        except RateLimited as limited:
            if produced:
                raise  # part of the answer came from the cloud already: the caller decides
            self._cloud_after = time.monotonic() + limited.retry_after_s
            self.router.observe_overload()
            report.route = Route.EDGE_ONLY.value
            report.reason = (
                f"verifier rate limit ({limited.retry_after_s:.2f} s): finished on the device"
            )
            yield from counted(self._on_route(Route.EDGE_ONLY, prompt_ids, report))
        except (VerifierUnreachable, grpc.RpcError) as lost:
            if isinstance(lost, grpc.RpcError) and lost.code() not in TRANSIENT:  # type: ignore[attr-defined]
                raise
            self._up = False  # the next request checks health again, and returns when SERVING
            self.router.verifier_down()
            yield from counted(
                finish_on_device(
                    prompt_ids,
                    list(produced),
                    self.decode,
                    self.runtime,
                    self.router.speculation,
                    report,
                    lost,
                )
            )
        report.seconds = time.perf_counter() - started
        if verifier is not None:
            report.round_trips = verifier.calls - calls0
            report.one_way = verifier.one_way - one_way0
            report.bytes_up = verifier.bytes_up - up0
            report.bytes_down = verifier.bytes_down - down0
            if verifier.overloads > overloads0:
                self.router.observe_overload()
        if not report.finished_on_device:  # an outage says nothing about the route's rate
            self.router.observe(report.outcome(rtt), self.objective)

    def _route(self, forced: str | None) -> tuple[Route, str]:
        """The router's choice (or the caller's), overruled while rate limited or down."""
        decision = self.router.choose(self.objective)
        route = Route(forced) if forced else decision.route
        reason = "forced by caller" if forced else decision.reason
        wait_s = self._cloud_after - time.monotonic()
        if route != Route.EDGE_ONLY and wait_s > 0:
            return Route.EDGE_ONLY, f"verifier rate limit: {wait_s:.2f} s left"
        if route != Route.EDGE_ONLY and self.verifier is not None and not self._up:
            return Route.EDGE_ONLY, "verifier down (health check): decoded on the device"
        return route, reason

    def _on_route(
        self, route: Route, prompt_ids: Sequence[int], report: RequestReport
    ) -> Iterator[list[int]]:
        """This client's decoding of `prompt_ids` on `route`."""
        return decode_on_route(
            route,
            prompt_ids,
            self.decode,
            self.runtime,
            self.verifier,
            self.router.speculation,
            report,
        )

    def measure_rtt(self, force: bool = False) -> float:
        """The round trip now, told to the router: while the verifier is up, the shortest exchange
        of the last `rtt_max_age_s` (measured for free by the calls themselves); else, or with
        `force` (call it on a network change: older exchanges are forgotten), a health check,
        which also marks the verifier down when it is unreachable or not SERVING."""
        if self.verifier is None:
            return 0.0
        if force:
            self.verifier.forget_round_trips()
        recent = self.verifier.recent_round_trip(self.rtt_max_age_s) if self._up else None
        if recent is None:
            try:
                if not self._up:
                    self.verifier.ping()  # a fresh channel's first call also pays for connecting
                recent = self.verifier.ping()
            except (grpc.RpcError, VerifierUnreachable):
                self._up = False
                self.router.verifier_down()
                return 0.0
            self._up = True
        self.router.observe_rtt(recent)
        return recent
