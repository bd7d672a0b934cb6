"""What one request cost and how it was served: the report the caller reads and the router learns from."""

from __future__ import annotations

from dataclasses import dataclass

from fedge.edge.router import Outcome, Route


@dataclass
class RequestReport:
    """How one request was served: route, why, and its decoding figures (whole request)."""

    route: str  # where the request ended: edge-only after a fallback to the device
    reason: str
    tokens: int = 0
    seconds: float = 0.0
    ttft_s: float = 0.0
    rounds: int = 0  # target passes in the cloud (verifies, or streamed tokens)
    round_trips: int = 0  # request/response exchanges waited on: health checks, retries included
    one_way: int = 0  # messages sent without waiting for a reply (CloseSession)
    drafted: int = 0  # draft steps on the device
    acceptance: float = 0.0  # accepted / drafted over the speculative part
    bytes_up: int = 0
    bytes_down: int = 0
    cloud_seconds: float = 0.0  # time spent waiting on the verifier, network included
    cloud_tokens: int = 0  # of `tokens`, those the verifier produced before it was lost
    finished_on_device: bool = False  # the verifier became unreachable mid-request

    def outcome(self, rtt_s: float) -> Outcome:
        """The router's view of this request, measured at round trip `rtt_s`."""
        return Outcome(
            Route(self.route),
            self.tokens,
            self.seconds,
            self.ttft_s,
            passes=self.rounds,
            bytes=self.bytes_up + self.bytes_down,
            round_trips=self.round_trips,
            drafted=self.drafted,
            cloud_seconds=self.cloud_seconds,
            rtt_s=rtt_s,
        )
