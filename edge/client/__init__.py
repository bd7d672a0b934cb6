"""Edge-side client of the verifier: the gRPC link (sessions, recovery, streams) and the device library.

Modules, one job each:

- `config`: `ClientConfig` and the failures (`VerifierUnreachable`, `RateLimited`,
  `TokenizerMismatch`);
- `transport`: the channel, round-trip and byte accounting, overload retries, health;
- `verifier`: `VerifierClient`, sessions that survive retries and restarts, cloud-only streams;
- `routes`: decoding one request on one route, recording what it cost;
- `fallback`: finishing a request on the device when the verifier is lost;
- `report`: `RequestReport`, what one request cost, and the router's view of it;
- `device`: `EdgeClient`, per request: route, decode, fall back, report, learn.
"""

from fedge.edge.client.config import (
    ClientConfig,
    RateLimited,
    TokenizerMismatch,
    VerifierUnreachable,
)
from fedge.edge.client.device import EdgeClient
from fedge.edge.client.report import RequestReport
from fedge.edge.client.verifier import VerifierClient

__all__ = [
    "ClientConfig",
    "EdgeClient",
    "RateLimited",
    "RequestReport",
    "TokenizerMismatch",
    "VerifierClient",
    "VerifierUnreachable",
]
