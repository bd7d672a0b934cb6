"""`fedge edge export` of each of six Hugging Face architectures: KV cache, fp32/int8/int4, valid, exact.

Per architecture (tests/architectures.py: Llama, Qwen2, Mistral, GPT-2, Phi-3, Gemma), the
CLI exports a random-weight model to ONNX with explicit KV-cache tensors, quantizes it to
int8 and 4-bit, and validates every variant against torch (the manifest's `valid`). Then
the fp32 ONNX draft decodes greedily token for token as the torch model does, and each ONNX
variant as the draft of greedy speculative decoding against a real verifier (the engine
the gRPC service runs) emits exactly the target's own `generate`.

Not part of `make test` (the dynamo ONNX export costs 5-15 s per model): run it with
`make test-archs` (``pytest -m archs tests/archs``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder, edge_only
from fedge.edge.runtime import TorchDraftRuntime, load_draft_runtime
from fedge.edge.verifier.engine import EngineConfig, VerifierEngine
from fedge.models import load_causal_lm
from tests.architectures import ARCHITECTURES, greedy_reference, model_dir

pytestmark = pytest.mark.archs

PROMPTS = [[5, 17, 300, 42], [9], [100, 200, 300, 400, 500, 600, 7, 8, 9, 10, 11]]
NEW_TOKENS = 16
VARIANTS = ("fp32", "int8", "int4")


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_export_is_valid_and_decodes_as_torch_does(name: str, micro_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    draft_dir = model_dir(name, tmp_path, micro_zoo, seed=1)
    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["edge", "export", str(draft_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["past_names"]) == 2 * ARCHITECTURES[name][0].num_hidden_layers
    for variant in VARIANTS:
        entry = manifest["variants"][variant]
        assert entry["valid"], (variant, entry["failures"])
    assert manifest["variants"]["fp32"]["max_abs_logit_diff"] < 1e-3
    draft = load_causal_lm(draft_dir)
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, draft_len=4, adaptive=False)
    onnx_fp32 = load_draft_runtime(out, "onnx-fp32")
    for prompt in PROMPTS:
        assert list(edge_only(onnx_fp32, prompt, config)) == list(
            edge_only(TorchDraftRuntime(draft), prompt, config)
        )
    target = load_causal_lm(model_dir(name, tmp_path, micro_zoo, seed=0))
    target.generation_config.eos_token_id = None  # the decoder has no stop token either
    engine = VerifierEngine(target, EngineConfig(batch_window_s=0.0)).start()
    try:
        for variant in VARIANTS:
            decoder = SpeculativeDecoder(load_draft_runtime(out, f"onnx-{variant}"), engine, config)
            for prompt in PROMPTS:
                expected = greedy_reference(target, prompt, NEW_TOKENS)
                assert decoder.generate(prompt) == expected, (variant, prompt)
    finally:
        engine.stop()
