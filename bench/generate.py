"""Cloud-only Generate for a lone stream vs plain Hugging Face greedy decoding of the same model.

The ratio (Generate tokens/s over `model.generate` tokens/s, same prompts, same
greedy tokens, same torch threads) is the verifier's per-stream overhead: gRPC on
loopback, the engine's worker thread, KV bookkeeping. Goal: >= 0.9. The verifier runs
as deployed, in its own process (`fedge verifier serve`); also reported, as a second
figure, a verifier in the bench's own process, where the client's thread competes with
the server's for one interpreter lock. Prints one JSON object on the last line and writes
bench/results/generate.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

if not __package__:  # run as `python bench/x.py`: put the repo root first (bench/_bootstrap.py)
    import _bootstrap  # noqa: F401

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="micro", help="zoo preset (micro, demo, default)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of plain decoding and the verifier"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from fedge.edge.client import ClientConfig, VerifierClient
    from fedge.edge.prompts import heldout_prompts
    from fedge.edge.verifier.server import BackgroundServer, ServerConfig
    from fedge.models import load_causal_lm, load_tokenizer
    from fedge.simulations.verifier_process import VerifierProcess
    from fedge.zoo import ensure_zoo

    zoo = ensure_zoo(args.preset)
    model = load_causal_lm(zoo.target_dir)
    prompts = [p[:16] for p in heldout_prompts(load_tokenizer(zoo.target_dir), args.prompts, 16)]

    def hf(prompt: list[int]) -> list[int]:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            do_sample=False,
        )
        return [int(t) for t in out[0, len(prompt) :]]

    hf(prompts[0])  # warm up
    started = time.perf_counter()
    expected = [hf(p) for p in prompts]
    hf_s = time.perf_counter() - started

    def timed(port: int) -> tuple[float, list[list[int]]]:
        with VerifierClient(ClientConfig(f"127.0.0.1:{port}")) as client:
            list(client.generate(prompts[0], args.tokens))  # warm up
            started = time.perf_counter()
            produced = [list(client.generate(p, args.tokens)) for p in prompts]
            return time.perf_counter() - started, produced

    server = VerifierProcess(zoo.target_dir, torch_threads=args.threads)
    try:
        generate_s, produced = timed(server.port)
    finally:
        server.stop()
    config = ServerConfig(zoo.target_dir, drain_notice_s=0.0)
    with BackgroundServer(config, model) as background:
        in_process_s, produced_in_process = timed(background.port)
    n = args.tokens * len(prompts)
    result = {
        "preset": args.preset,
        "tokens": n,
        "hf_greedy_tok_s": n / hf_s,
        "generate_tok_s": n / generate_s,
        "ratio": hf_s / generate_s,
        "goal": 0.9,
        "identical": produced == expected and produced_in_process == expected,
        "torch_threads": args.threads,
        "in_process_generate_tok_s": n / in_process_s,
        "in_process_ratio": hf_s / in_process_s,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
