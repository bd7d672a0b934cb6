"""Code-instruction data from the stdlib: signature + docstring ask, body answers, clients by package."""

from __future__ import annotations

import textwrap

import pytest

from fedge.data.corpus import SourceFile, stdlib_sources
from fedge.data.instructions import (
    IGNORE_INDEX,
    encode_example,
    examples_by_client,
    function_examples,
)
from fedge.models import load_tokenizer
from fedge.zoo import ZooPaths

SOURCE = textwrap.dedent(
    '''
    import os

    def no_doc(x):
        return x

    def only_doc():
        """Nothing else."""

    @staticmethod
    def join(a: str,
             b: str) -> str:
        """Join two parts.

        With a slash.
        """
        # a comment in the body stays
        return a + "/" + b

    class Box:
        def size(self):
            """How big."""
            return 3

        async def fetch(self, key):
            """Get `key`."""

            def inner():
                """Helper."""
                return key

            return inner()
    '''
)


def example_file() -> SourceFile:
    return SourceFile(path="pkg/mod.py", label="pkg", text=SOURCE)


def test_functions_with_a_docstring_and_a_body_become_examples_in_source_order() -> None:
    """Undocumented and body-less functions are skipped; methods and nested functions count."""
    examples = function_examples(example_file())
    assert [e.name for e in examples] == ["join", "Box.size", "Box.fetch", "Box.fetch.inner"]
    assert all(e.label == "pkg" for e in examples)


def test_instruction_and_response_are_the_functions_own_source() -> None:
    """Signature (over two lines, decorator left out) and docstring ask; the body answers,
    indented as under the signature, its comments kept."""
    join, size = function_examples(example_file())[:2]
    assert join.instruction.startswith("def join(a: str,\n         b: str) -> str:\n")
    assert join.instruction.endswith('    With a slash.\n    """\n')
    assert join.response == '    # a comment in the body stays\n    return a + "/" + b\n'
    assert "@staticmethod" not in join.instruction
    assert size.instruction + size.response == (
        'def size(self):\n    """How big."""\n    return 3\n'
    )


def test_clients_hold_their_packages_examples_and_the_split_follows_the_file() -> None:
    """On the real corpus: one client per package, each example from a file of that package,
    training clients from training files only and held-out ones from held-out files only."""
    files = stdlib_sources(max_chars_per_label=20_000)
    train = examples_by_client(files)
    heldout = examples_by_client(files, heldout=True)
    assert len(train) >= 10 and heldout
    for clients, wanted in ((train, False), (heldout, True)):
        for label, examples in clients.items():
            assert all(e.label == label and e.heldout is wanted for e in examples)
    assert sum(map(len, train.values())) >= 200


@pytest.fixture(scope="module")
def tokenizer(micro_zoo: ZooPaths):  # type: ignore[no-untyped-def]
    return load_tokenizer(micro_zoo.target_dir)


def test_without_a_chat_template_the_prompt_is_the_instruction_and_only_the_response_is_a_target(
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    join = function_examples(example_file())[0]
    encoded = encode_example(tokenizer, join, max_length=512)
    n = encoded.prompt_length
    assert encoded.labels[:n] == [IGNORE_INDEX] * n
    assert tokenizer.decode(encoded.input_ids[:n], skip_special_tokens=True) == join.instruction
    response = encoded.labels[n:]
    assert response == encoded.input_ids[n:] and response[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(response, skip_special_tokens=True) == join.response
    short = encode_example(tokenizer, join, max_length=n + 3)
    assert len(short.input_ids) == len(short.labels) == n + 3


def test_with_a_chat_template_the_prompt_is_the_user_turn_and_the_answer_the_assistants(
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    """The template's user turn and generation prompt are not targets; the assistant's turn is."""
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}[end]\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]\n{% endif %}"
    )
    try:
        size = function_examples(example_file())[1]
        encoded = encode_example(tokenizer, size, max_length=512)
    finally:
        tokenizer.chat_template = None
    n = encoded.prompt_length
    prompt = tokenizer.decode(encoded.input_ids[:n], skip_special_tokens=True)
    answer = tokenizer.decode(encoded.labels[n:], skip_special_tokens=True)
    assert prompt == f"[user]\n{size.instruction}[end]\n[assistant]\n"
    assert answer == f"{size.response}[end]\n"
