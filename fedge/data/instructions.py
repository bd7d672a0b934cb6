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
"""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fedge.data.corpus import SourceFile, is_heldout
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
