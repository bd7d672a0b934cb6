"""fedge's verifier serves any of six Hugging Face architectures; greedy speculative output equals the target's.

Per architecture (tests/architectures.py: Llama, Qwen2, Mistral, GPT-2, Phi-3, Gemma), a
real verifier (`BackgroundServer`: gRPC on 127.0.0.1, the engine the service runs) serves a
random-weight target, and the edge client's `SpeculativeDecoder` drafts with two torch
drafts: the target itself (every draft accepted: multi-token verifies) and a second random
model of the same architecture and vocabulary (most drafts rejected: the KV rollback on
both sides). Both must emit exactly the target's own greedy `generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.verifier.engine import EngineConfig
from fedge.edge.verifier.server import BackgroundServer, ServerConfig, load_verifier_model
from fedge.models import load_causal_lm
from tests.architectures import ARCHITECTURES, greedy_reference, model_dir

PROMPTS = [[5, 17, 300, 42], [9], [100, 200, 300, 400, 500, 600, 7, 8, 9, 10, 11]]
NEW_TOKENS = 16


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_speculative_decoding_over_grpc_equals_the_targets_generate(
    name: str, micro_zoo, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    target_dir = model_dir(name, tmp_path, micro_zoo, seed=0)
    target = load_verifier_model(target_dir)
    target.generation_config.eos_token_id = None  # the decoder has no stop token either
    other = load_causal_lm(model_dir(name, tmp_path, micro_zoo, seed=1))
    config = ServerConfig(
        target_dir, drain_notice_s=0.0, engine=EngineConfig(max_draft=8, batch_window_s=0.0)
    )
    server = BackgroundServer(config, target)
    port = server.start()
    decode = DecodeConfig(
        max_new_tokens=NEW_TOKENS, draft_len=4, adaptive=False, confidence_floor=0.0
    )
    accepted = {}
    try:
        with VerifierClient(ClientConfig(f"127.0.0.1:{port}")) as client:
            for label, draft in (("self", target), ("other", other)):
                decoder = SpeculativeDecoder(TorchDraftRuntime(draft), client, decode)
                accepted[label] = 0
                for prompt in PROMPTS:
                    expected = greedy_reference(target, prompt, NEW_TOKENS)
                    assert decoder.generate(prompt) == expected, (label, prompt)
                    accepted[label] += decoder.stats.accepted
                    assert decoder.stats.tokens == NEW_TOKENS
    finally:
        server.stop(grace_s=0.2)
    # the target as draft: 3 verifies of 4 accepted drafts + 1 token, then 1 token alone
    assert accepted["self"] == len(PROMPTS) * 4 * (NEW_TOKENS // 5)
    assert accepted["other"] < accepted["self"]
