"""What TLS and a device token cost a verify through the fleet's ingress, against plaintext.

One fleet (micro target, one replica) and two ingresses in front of the same replica:
the fleet's own, plaintext and open, and a second one with TLS on its listener (a
self-signed localhost certificate) and a token per device from a credentials file. A
client of each (the secure one verifying the certificate and sending its token) runs the
same sequential workload, a session per round and drafts of 4 tokens, calls alternating
between the two ingresses so machine noise hits both alike. The relay to the replica and
the replica's work are shared; the difference is the ingress's listener and its check.

Reported: p50/p99 verify round trip through each ingress and the secure one's ratio to
the plaintext one. Goal: p50 <= 1.1x. Usage: ``python bench/fleet_tls.py [--rounds 8]
[--verifies 40]``. The last line is one JSON object, also written to
``bench/results/fleet_tls.json``.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

from bench._common import (
    alternating_args,
    alternating_verifies,
    loadavg,
    percentiles,
    write_result,
)
from bench._fleet_setup import Secure, secure_material

RESULTS_FILE = Path(__file__).resolve().parent / "results" / "fleet_tls.json"
DRAFT = 4
SECURE_INGRESS = "fedge-ingress-tls"


def secure_ingress_port(fleet: Any, secure: Secure) -> int:
    """Deploy a TLS + token ingress in front of the fleet's stable version; its port."""
    from ray import serve

    from fedge.edge.fleet.app import ingress_application

    spec = replace(
        fleet.config.ingress_spec(fleet.describe()["stable"], port=0),
        credentials_file=secure.credentials,
        tls_cert=secure.cert,
        tls_key=secure.key,
    )
    handle = serve.run(ingress_application(spec), name=SECURE_INGRESS, route_prefix=None)
    return int(handle.port.remote().result())


def clients(plain_port: int, secure_port: int, secure: Secure) -> dict[str, Any]:
    """A verifier client of each ingress, the secure one with the device's token and the CA."""
    from fedge.edge.client import ClientConfig, VerifierClient

    return {
        "plaintext": VerifierClient(ClientConfig(f"127.0.0.1:{plain_port}", device_id="device-0")),
        "tls+auth": VerifierClient(
            ClientConfig(
                f"127.0.0.1:{secure_port}",
                device_id="device-0",
                token=secure.tokens[0],
                root_cert=secure.cert,
            )
        ),
    }


def main() -> None:
    args = alternating_args(__doc__.splitlines()[0])

    from fedge.edge.fleet.app import FleetConfig, start_fleet
    from fedge.edge.prompts import heldout_prompts
    from fedge.edge.verifier.engine import EngineConfig
    from fedge.models import load_tokenizer
    from fedge.zoo import ensure_zoo

    zoo = ensure_zoo("micro")
    prompt = heldout_prompts(load_tokenizer(zoo.target_dir), 1, 32)[0]
    config = FleetConfig(zoo.target_dir, replicas=1, engine=EngineConfig(max_draft=8))
    with tempfile.TemporaryDirectory(prefix="fedge-bench-fleet-tls-") as material:
        secure = secure_material(Path(material), devices=1)
        fleet = start_fleet(config)
        try:
            running = clients(fleet.port, secure_ingress_port(fleet, secure), secure)
            load_before = loadavg()
            alternating_verifies(running, prompt[:DRAFT], prompt, 5)  # warm-up
            samples: dict[str, list[float]] = {name: [] for name in running}
            for _ in range(args.rounds):
                rounds = alternating_verifies(running, prompt[:DRAFT], prompt, args.verifies)
                for name, seconds in rounds.items():
                    samples[name] += seconds
            for client in running.values():
                client.close_channel()
        finally:
            fleet.stop()
    stats = percentiles(samples)
    base, tls = stats["plaintext"], stats["tls+auth"]
    tls["p50_ratio"] = tls["p50_ms"] / base["p50_ms"]
    tls["p99_ratio"] = tls["p99_ms"] / base["p99_ms"]
    write_result(
        RESULTS_FILE,
        {
            "bench": "fleet_tls",
            "model": "micro",
            "replicas": 1,
            "verifies_per_config": args.rounds * args.verifies,
            "draft_tokens": DRAFT,
            "configs": stats,
            "goal_p50_ratio": 1.1,
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
    )


if __name__ == "__main__":
    main()
