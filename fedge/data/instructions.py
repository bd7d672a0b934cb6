"""Code-instruction data from the standard library: a function's signature and docstring ask, its body answers.

Every function or method of the corpus (`fedge.data.corpus`) that has a docstring and a body
besides it becomes one example: the instruction is its source from the `def` line through the
docstring, the response the rest of its body, so instruction + response is the function's own
source (dedented to its `def`). Clients hold the examples of one package each (the corpus label);
a file's examples are held out when the file is (the corpus's path-hash split), so no
held-out function's body was ever trained on.

Encoded for a causal LM, an example is the prompt then the response, and only the response is
a target (labels -100 on the prompt). Where the tokenizer defines a chat template, the prompt is
the template's user turn plus its generation prompt and the response its assistant turn;
otherwise the prompt is the instruction's own text, after BOS where the tokenizer adds BOS
(`fedge.lm.bos`), and the response ends with EOS.

For a federation (``data-kind = "instructions"``), :func:`build_instruction_corpus` writes the
examples as a `fedge.data.federated.FederatedCorpus` whose streams hold one example per slot of
``seq-len`` tokens (cut to it, padded after it), so every disjoint held-out window is one
example from its start. A token that is input but never a target (the prompt, the padding) is
stored as its bitwise complement ``~t`` (negative; :func:`input_only`), so the same windows,
shards and memory maps carry the mask and `fedge.lm.evaluate.split_window` reads it back.
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge.data.corpus import SourceFile, is_heldout, stdlib_sources
from fedge.data.federated import FederatedCorpus
from fedge.errors import DataError
from fedge.lm.bos import bos_token_id, with_bos

IGNORE_INDEX = -100  # label of a position that is not a target (the prompt)
MAX_FUNCTION_CHARS = 4_000  # longer functions make examples longer than a small model's context


@dataclass(frozen=True)
class InstructionExample:
    """One function: where it lives, what asks for it, and its body."""

    path: str  # the file, relative to the standard library
    label: str  # its package: the client that holds it
    name: str  # qualified name within the file (Class.method)
    instruction: str  # signature and docstring, as written
    response: str  # the body after the docstring, indented as under the signature

    @property
    def heldout(self) -> bool:
        """Whether the example's file is in the held-out split."""
        return is_heldout(self.path)


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of prompt + response and the labels (IGNORE_INDEX over the prompt)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def prompt_length(self) -> int:
        """Positions before the response."""
        return next((i for i, label in enumerate(self.labels) if label != IGNORE_INDEX), 0)


def function_examples(
    source: SourceFile, max_chars: int = MAX_FUNCTION_CHARS
) -> list[InstructionExample]:
    """The examples of one file, in source order (a file that does not parse gives none)."""
    try:
        tree = ast.parse(source.text)
    except (SyntaxError, ValueError):
        return []
    lines = source.text.splitlines(keepends=True)
    out: list[InstructionExample] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                example = _example(source, lines, child, name, max_chars)
                if example is not None:
                    out.append(example)
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def _example(
    source: SourceFile,
    lines: list[str],
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    name: str,
    max_chars: int,
) -> InstructionExample | None:
    """The example of one function: None without a docstring or a body after it, or too long."""
    if ast.get_docstring(node) is None or len(node.body) < 2 or node.end_lineno is None:
        return None
    docstring = node.body[0]
    if docstring.end_lineno is None:
        return None
    whole = lines[node.lineno - 1 : node.end_lineno]  # def line (decorators left out) to end
    cut = docstring.end_lineno - node.lineno + 1
    if not whole[0].lstrip().startswith(("def ", "async def ")) or any(
        line.strip() for line in _after(lines[docstring.end_lineno - 1], docstring.end_col_offset)
    ):
        return None  # a one-line def with its body on the def line, or code after the docstring
    function = textwrap.dedent("".join(whole))
    if len(function) > max_chars:
        return None
    dedented = function.splitlines(keepends=True)
    instruction, response = "".join(dedented[:cut]), "".join(dedented[cut:])
    if not response.strip():
        return None
    return InstructionExample(source.path, source.label, name, instruction, response)


def _after(line: str, column: int | None) -> list[str]:
    """What follows column `column` of `line` (a `;` and more code after a docstring, say)."""
    rest = line[column:] if column is not None else ""
    return [rest.split("#", 1)[0]]


def examples_by_client(
    files: list[SourceFile], heldout: bool = False
) -> dict[str, list[InstructionExample]]:
    """Each package's examples from its training files (or, with `heldout`, its held-out ones)."""
    clients: dict[str, list[InstructionExample]] = defaultdict(list)
    for source in files:
        if source.heldout != heldout:
            continue
        clients[source.label].extend(function_examples(source))
    return {label: examples for label, examples in sorted(clients.items()) if examples}


def encode_example(tokenizer: Any, example: InstructionExample, max_length: int) -> EncodedExample:
    """Prompt and response ids, the response alone a target; cut to `max_length` tokens."""
    if getattr(tokenizer, "chat_template", None):
        prompt, full = _chat_texts(tokenizer, example)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        full_ids = tokenizer.encode(full, add_special_tokens=False)
        if full_ids[: len(prompt_ids)] == prompt_ids:
            response_ids = full_ids[len(prompt_ids) :]
        else:  # the two renderings tokenized apart at the seam: encode the rest on its own
            response_ids = tokenizer.encode(full[len(prompt) :], add_special_tokens=False)
        prompt_ids = with_bos(prompt_ids, bos_token_id(tokenizer))
    else:
        prompt_ids = with_bos(
            tokenizer.encode(example.instruction, add_special_tokens=False),
            bos_token_id(tokenizer),
        )
        response_ids = tokenizer.encode(example.response, add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            response_ids = [*response_ids, int(tokenizer.eos_token_id)]
    ids = [*prompt_ids, *response_ids][:max_length]
    labels = [IGNORE_INDEX] * len(prompt_ids) + [int(t) for t in response_ids]
    return EncodedExample([int(t) for t in ids], labels[:max_length])


def _chat_texts(tokenizer: Any, example: InstructionExample) -> tuple[str, str]:
    """The chat template's rendering of the user turn (with the generation prompt) and of the
    whole exchange."""
    user = {"role": "user", "content": example.instruction}
    assistant = {"role": "assistant", "content": example.response}
    prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([user, assistant], tokenize=False)
    return str(prompt), str(full)


# ---------------------------------------------------------------- the federated corpus
CORPUS_FORMAT = 1  # bump when the stream layout changes (part of the cache key)
MIN_TRAIN_EXAMPLES = 20  # a package with fewer is no client: too little to train on
MIN_HELDOUT_EXAMPLES = 5  # ... or too few held-out examples to measure it


def input_only(ids: np.ndarray) -> np.ndarray:
    """Token ids marked as input only (never a target): their bitwise complement, negative."""
    return np.bitwise_not(np.asarray(ids, dtype=np.int32))


def example_slot(
    encoded: EncodedExample, slot: int, pad: int, bos: int | None
) -> np.ndarray | None:
    """One example as `slot` stream tokens: cut, padded with input-only `pad`, prompt input-only.

    Without the tokenizer's leading BOS (the windows put BOS first themselves where the model
    wants it). None when no response token fits in the slot.
    """
    ids, labels = list(encoded.input_ids), list(encoded.labels)
    if bos is not None and ids and ids[0] == bos:
        ids, labels = ids[1:], labels[1:]
    ids, labels = ids[:slot], labels[:slot]
    if not any(label != IGNORE_INDEX for label in labels):
        return None
    row = np.array(ids, dtype=np.int32)
    out = np.where(np.array(labels) == IGNORE_INDEX, input_only(row), row).astype(np.int32)
    return np.concatenate([out, np.full(slot - len(out), ~pad, dtype=np.int32)])


def build_instruction_corpus(
    tokenizer_dir: str | Path,
    slot: int,
    max_chars_per_client: int | None = None,
    cache_root: Path | None = None,
) -> FederatedCorpus:
    """Code-instruction streams per stdlib package (one client each), built once and cached.

        A package none of whose files is in the held-out split holds out its last file's examples
        (still held out by file). Packages with fewer than MIN_TRAIN_EXAMPLES training or
    MIN_HELDOUT_EXAMPLES held-out examples are no client.
    """
    from fedge.models import load_tokenizer
    from fedge.paths import corpus_cache_dir

    tokenizer = load_tokenizer(tokenizer_dir)
    files = stdlib_sources(max_chars_per_label=max_chars_per_client)
    minimums = f"{MIN_TRAIN_EXAMPLES},{MIN_HELDOUT_EXAMPLES}"
    digest = hashlib.sha256(f"{CORPUS_FORMAT}\0{slot}\0{minimums}\0".encode())
    digest.update(hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).digest())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    for source in files:
        digest.update(f"{source.path}\0{source.label}\0{len(source.text)}\0".encode())
    directory = (cache_root or corpus_cache_dir()) / f"instructions-{digest.hexdigest()[:16]}"
    if (directory / "clients.json").is_file():
        return FederatedCorpus(directory)
    bos = bos_token_id(tokenizer)
    pad = int(
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    by_label: dict[str, list[SourceFile]] = defaultdict(list)
    for source in files:
        by_label[source.label].append(source)
    clients: list[dict[str, Any]] = []
    for label, sources in sorted(by_label.items()):
        held = {s.path for s in sources if s.heldout} or {sources[-1].path}
        if len(held) == len(sources):
            continue  # one file only: nothing left to train on
        split: dict[bool, list[np.ndarray]] = {False: [], True: []}
        names: dict[bool, list[str]] = {False: [], True: []}
        for source in sources:
            for example in function_examples(source):
                row = example_slot(encode_example(tokenizer, example, slot + 1), slot, pad, bos)
                if row is not None:
                    split[source.path in held].append(row)
                    names[source.path in held].append(f"{source.path}:{example.name}")
        if len(split[False]) < MIN_TRAIN_EXAMPLES or len(split[True]) < MIN_HELDOUT_EXAMPLES:
            continue
        position = len(clients)
        train, heldout = (np.concatenate(split[k]) for k in (False, True))
        np.save(staging / f"{position:04d}.train.npy", train)
        np.save(staging / f"{position:04d}.heldout.npy", heldout)
        clients.append(
            {
                "client_id": label,
                "documents": sorted({s.path for s in sources}),
                "labels": {label: len(sources)},
                "train_tokens": len(train),
                "heldout_tokens": len(heldout),
                "train_examples": len(split[False]),
                "heldout_examples": len(split[True]),
                "heldout_names": names[True],
            }
        )
    if not clients:
        raise DataError("no stdlib package has both training and held-out instruction examples")
    spec = {"scheme": "natural", "kind": "instructions", "slot": slot, "format": CORPUS_FORMAT}
    (staging / "clients.json").write_text(json.dumps({"spec": spec, "clients": clients}))
    shutil.rmtree(directory, ignore_errors=True)
    staging.replace(directory)
    return FederatedCorpus(directory)


@dataclass(frozen=True)
class HeldoutPrompt:
    """A held-out example ready to decode: prompt ids, the true response's ids, the instruction."""

    prompt_ids: list[int]
    response_ids: list[int]
    instruction: str


def heldout_prompts(
    tokenizer: Any,
    count: int,
    max_prompt_tokens: int,
    min_response_tokens: int,
    labels: list[str] | None = None,
    max_chars_per_client: int | None = None,
) -> list[HeldoutPrompt]:
    """`count` held-out examples, spread over the packages.

    Prompts as `encode_example` makes them (chat template and BOS where the tokenizer has them),
    at most `max_prompt_tokens` long, with responses of at least `min_response_tokens` tokens;
    `labels` limits them to those packages. Round-robin over packages, each in source order.
    """
    files = [f for f in stdlib_sources(max_chars_per_label=max_chars_per_client) if f.heldout]
    queues: dict[str, list[HeldoutPrompt]] = defaultdict(list)
    for source in files:
        if labels is not None and source.label not in labels:
            continue
        for example in function_examples(source):
            encoded = encode_example(
                tokenizer, example, max_prompt_tokens + 4 * min_response_tokens
            )
            cut = encoded.prompt_length
            response = encoded.input_ids[cut:]
            if 0 < cut <= max_prompt_tokens and len(response) >= min_response_tokens:
                queues[source.label].append(
                    HeldoutPrompt(encoded.input_ids[:cut], response, example.instruction)
                )
    out: list[HeldoutPrompt] = []
    while len(out) < count and any(queues.values()):
        for label in sorted(queues):
            if queues[label] and len(out) < count:
                out.append(queues[label].pop(0))
    if len(out) < count:
        raise DataError(
            f"only {len(out)} held-out instructions of at most {max_prompt_tokens} tokens with "
            f"{min_response_tokens}+ response tokens; {count} were asked for"
        )
    return out
