"""On-device fallback: finish a request with the draft when the verifier is lost mid-request."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from fedge.edge.client.report import RequestReport
from fedge.edge.client.routes import decode_on_route
from fedge.edge.decoder import DecodeConfig
from fedge.edge.draftlen import SpeculationEstimator
from fedge.edge.router import Route
from fedge.edge.runtime import DraftRuntime


def loss_reason(produced: int, lost: Exception) -> str:
    """The report's reason: after how many tokens, and what the verifier answered."""
    why = getattr(lost, "code", lambda: None)() or type(lost).__name__
    return f"verifier unreachable after {produced} tokens ({why}): finished on the device"


def finish_on_device(
    prompt_ids: Sequence[int],
    produced: list[int],
    decode: DecodeConfig,
    runtime: DraftRuntime,
    estimator: SpeculationEstimator,
    report: RequestReport,
    lost: Exception,
) -> Iterator[list[int]]:
    """Decode what the request still owes with the draft alone, continuing after `produced`,
    and say so in `report` (route edge-only, `finished_on_device`, `cloud_tokens`)."""
    report.reason = loss_reason(len(produced), lost)
    report.route = Route.EDGE_ONLY.value
    report.finished_on_device = True
    report.cloud_tokens = len(produced)
    remaining = decode.max_new_tokens - len(produced)
    if remaining <= 0 or (produced and produced[-1] == decode.stop_token_id):
        return
    rest = dataclasses.replace(decode, max_new_tokens=remaining)
    context = [*prompt_ids, *produced]
    yield from decode_on_route(Route.EDGE_ONLY, context, rest, runtime, None, estimator, report)
