"""Decoding one request on one route (edge-only, speculative, cloud-only), recording what it cost."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from fedge.edge.client.report import RequestReport
from fedge.edge.client.verifier import VerifierClient
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder, edge_only
from fedge.edge.draftlen import SpeculationEstimator
from fedge.edge.router import Route
from fedge.edge.runtime import DraftRuntime
from fedge.edge.verifier.engine import Sampling


def decode_on_route(
    route: Route,
    prompt_ids: Sequence[int],
    decode: DecodeConfig,
    runtime: DraftRuntime,
    verifier: VerifierClient | None,
    estimator: SpeculationEstimator,
    report: RequestReport,
) -> Iterator[list[int]]:
    """Yield token chunks on `route`; add its target passes, draft steps and cloud wait to `report`
    (also when the route fails part way, so a fallback reports the whole request)."""
    if route != Route.EDGE_ONLY and verifier is None:
        raise ValueError(f"route {route.value} needs a verifier; pass --verifier HOST:PORT")
    started = time.perf_counter()
    if route == Route.SPECULATIVE and verifier is not None:
        decoder = SpeculativeDecoder(runtime, verifier, decode, estimator)
        try:
            yield from decoder.stream(prompt_ids)
        finally:
            s = decoder.stats
            report.rounds += s.rounds
            report.drafted += s.drafted
            report.acceptance = s.acceptance
            report.cloud_seconds += s.verify_seconds
    elif route == Route.CLOUD_ONLY and verifier is not None:
        sampling = Sampling(decode.temperature, decode.seed)
        try:
            for chunk in verifier.generate_chunks(
                prompt_ids, decode.max_new_tokens, sampling, decode.stop_token_id
            ):
                report.rounds += len(chunk)  # one target pass per streamed token
                yield chunk
        finally:
            report.cloud_seconds += time.perf_counter() - started
    else:
        for token in edge_only(runtime, prompt_ids, decode):
            report.drafted += 1
            yield [token]
