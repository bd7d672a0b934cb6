"""What `fedge demo` ends on: a greedy completion with the draft's accepted tokens marked, beside
the true continuation (micro zoo, real verifier on loopback, the torch draft)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from fedge.edge.client import ClientConfig, VerifierClient
from fedge.edge.demo import showcase_view
from fedge.edge.prompts import heldout_examples, heldout_prompts
from fedge.edge.runtime import TorchDraftRuntime
from fedge.edge.showcase import CLOSE_MARK, OPEN_MARK, Showcase, ShowcaseView, greedy_showcase
from fedge.models import load_causal_lm, load_tokenizer
from fedge.zoo import ZooPaths

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def showcase(micro_zoo: ZooPaths, verifier_port: int) -> tuple[Showcase, list[int]]:
    """The micro zoo's showcase of its first held-out prompt, and the target's greedy tokens."""
    tokenizer = load_tokenizer(micro_zoo.target_dir)
    prompt, truth = heldout_examples(tokenizer, 4, 24, NEW_TOKENS)[1]
    runtime = TorchDraftRuntime(load_causal_lm(micro_zoo.draft_dir))
    with VerifierClient(ClientConfig(f"127.0.0.1:{verifier_port}")) as client:
        shown = greedy_showcase(runtime, client, tokenizer, prompt, truth, NEW_TOKENS)
        greedy = list(client.generate(prompt, NEW_TOKENS))
    return shown, greedy


def render(renderable: object, width: int, colour: bool) -> str:
    """What a colour terminal (ANSI codes kept) or a pipe / CI log receives."""
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        color_system="standard" if colour else None,
        force_terminal=colour,
    )
    console.print(renderable)
    return buffer.getvalue()


def test_the_completion_is_the_targets_greedy_output_with_both_origins(
    micro_zoo: ZooPaths, showcase: tuple[Showcase, list[int]]
) -> None:
    """The pieces join to the target's greedy text; some came from the draft, some not."""
    shown, greedy = showcase
    tokenizer = load_tokenizer(micro_zoo.target_dir)
    assert shown.completion == tokenizer.decode(greedy, skip_special_tokens=True)
    labels = {accepted for text, accepted in shown.pieces if text.strip()}
    assert labels == {True, False}, "the micro draft agrees sometimes: both kinds must show"
    assert shown.marked().replace(OPEN_MARK, "").replace(CLOSE_MARK, "") == shown.completion


@pytest.mark.parametrize("width", [80, 140])
def test_without_colour_accepted_runs_are_marked_and_the_truth_is_shown(
    showcase: tuple[Showcase, list[int]], width: int
) -> None:
    """A pipe or CI log keeps the marks as « » and shows the true continuation beside."""
    shown, _ = showcase
    text = render(ShowcaseView(shown, NEW_TOKENS), width, colour=False)
    assert OPEN_MARK in text and CLOSE_MARK in text
    assert "true continuation" in text and "greedy completion" in text
    first_run = next(t for t, kept in shown.pieces if kept and t.strip())
    assert first_run.strip() in text
    truth_word = max(shown.truth.split(), key=len)  # long words survive the panels' wrapping
    assert truth_word in text
    assert "\x1b[" not in text


def test_on_a_colour_terminal_accepted_runs_are_styled_not_bracketed(
    showcase: tuple[Showcase, list[int]],
) -> None:
    """A terminal shows accepted tokens green and underlined, with no « » in the code."""
    shown, _ = showcase
    text = render(ShowcaseView(shown, NEW_TOKENS), 140, colour=True)
    assert "\x1b[1;4;32m" in text  # bold, underlined, green
    assert OPEN_MARK not in text


def test_the_demo_summary_round_trips_to_the_same_view(
    showcase: tuple[Showcase, list[int]],
) -> None:
    """The edge stage stores the showcase as JSON; the demo's ending is rebuilt from it."""
    shown, _ = showcase
    view = showcase_view({"showcase": shown.as_dict()})
    assert view.showcase == shown
    assert render(view, 100, colour=False) == render(ShowcaseView(shown, 48), 100, colour=False)


def test_examples_continue_the_prompts_heldout_prompts_gives(micro_zoo: ZooPaths) -> None:
    """heldout_examples keeps heldout_prompts' prompts (benches rely on them) and adds the text
    that follows each in the held-out split."""
    tokenizer = load_tokenizer(micro_zoo.target_dir)
    examples = heldout_examples(tokenizer, 6, 16, 8)
    assert [p for p, _ in examples] == heldout_prompts(tokenizer, 6, 16)
    assert all(len(truth) == 8 for _, truth in examples)


def test_a_stop_token_ends_the_shown_completion(micro_zoo: ZooPaths, verifier_port: int) -> None:
    """`fedge demo --preset smollm2` showed its completion running past the end of the chat turn
    ("... system / user / I am"): the showcase decoded a fixed count with no stop token. With the
    turn's end as the stop token, the completion is the target's greedy text up to it."""
    tokenizer = load_tokenizer(micro_zoo.target_dir)
    prompt, truth = heldout_examples(tokenizer, 4, 24, NEW_TOKENS)[1]
    runtime = TorchDraftRuntime(load_causal_lm(micro_zoo.draft_dir))
    with VerifierClient(ClientConfig(f"127.0.0.1:{verifier_port}")) as client:
        greedy = list(client.generate(prompt, NEW_TOKENS))
        stop = greedy[
            NEW_TOKENS // 2
        ]  # a token the target emits mid-way stands in for the turn end
        shown = greedy_showcase(runtime, client, tokenizer, prompt, truth, NEW_TOKENS, stop)
    cut = greedy[: greedy.index(stop) + 1]
    assert len(cut) < NEW_TOKENS
    assert shown.completion == tokenizer.decode(cut, skip_special_tokens=True)
    assert shown.tokens == len(cut)
    assert f"{len(cut)} greedy tokens" in render(ShowcaseView(shown, NEW_TOKENS), 140, False)
