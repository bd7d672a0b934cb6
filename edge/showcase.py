"""What `fedge demo` ends on: a greedy completion with the draft's accepted tokens marked, beside the true continuation.

A held-out prompt is decoded greedily by speculative decoding; every verify returns the draft
tokens the target accepted and then one token of the target's own, so each generated token is
known to be the draft's (accepted) or the target's. Beside it stands what the held-out file
really says next. On a colour terminal accepted tokens are green and underlined; on a console
without colour (a pipe, a CI log) each run of them is put between « and », so the marks
survive as text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from fedge.edge.decoder import DecodeConfig, SpeculativeDecoder, VerifierLink
from fedge.edge.runtime import DraftRuntime

ACCEPTED_STYLE = "bold green underline"
OPEN_MARK, CLOSE_MARK = "«", "»"  # around each run of accepted tokens where there is no colour


@dataclass(frozen=True)
class Showcase:
    """A prompt, its greedy completion as (text, accepted by the target from the draft) pieces,
    and the held-out text's true continuation."""

    prompt: str
    pieces: list[tuple[str, bool]]
    truth: str
    tokens: int = 0  # tokens decoded (fewer than asked when a stop token ended the completion)

    @property
    def accepted_share(self) -> float:
        """Share of the completion's characters that came from the draft."""
        total = sum(len(text) for text, _ in self.pieces)
        return sum(len(text) for text, kept in self.pieces if kept) / total if total else 0.0

    @property
    def completion(self) -> str:
        """The completion as plain text."""
        return "".join(text for text, _ in self.pieces)

    def marked(self) -> str:
        """The completion with each run of accepted tokens between « and »."""
        return "".join(
            f"{OPEN_MARK}{text}{CLOSE_MARK}" if kept else text for text, kept in _runs(self.pieces)
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the pieces as [text, accepted] pairs)."""
        return {**asdict(self), "pieces": [list(p) for p in self.pieces], "marked": self.marked()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Showcase:
        """Inverse of `as_dict`."""
        pieces = [(str(t), bool(k)) for t, k in data["pieces"]]
        return cls(data["prompt"], pieces, data["truth"], int(data.get("tokens", 0)))


def greedy_showcase(
    runtime: DraftRuntime,
    link: VerifierLink,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    truth_ids: Sequence[int],
    new_tokens: int,
    stop_token_id: int | None = None,
) -> Showcase:
    """Decode `prompt_ids` greedily by speculative decoding and label each token's origin.

    Each verify yields `drafts[:accepted] + [target's next token]`: all but the last token
    of a chunk are accepted draft tokens. `stop_token_id` (the end of a chat turn) ends the
    completion; only the chunk it cuts short can mislabel one token, the stop token itself,
    which is never shown.
    """
    decoder = SpeculativeDecoder(
        runtime, link, DecodeConfig(max_new_tokens=new_tokens, stop_token_id=stop_token_id)
    )
    labelled: list[tuple[int, bool]] = []
    for chunk in decoder.stream(prompt_ids):
        labelled += [(token, True) for token in chunk[:-1]] + [(chunk[-1], False)]
    return Showcase(
        prompt=tokenizer.decode(list(prompt_ids), skip_special_tokens=True),
        pieces=list(_decoded_pieces(tokenizer, labelled)),
        truth=tokenizer.decode(list(truth_ids), skip_special_tokens=True),
        tokens=len(labelled),
    )


def _decoded_pieces(tokenizer: Any, labelled: list[tuple[int, bool]]) -> Iterator[tuple[str, bool]]:
    """Each token's text (the growth of the decoded prefix, so multi-byte characters split across
    tokens come out whole, on the token that completes them) with its label."""
    shown = ""
    for i, (_, accepted) in enumerate(labelled):
        text = tokenizer.decode([t for t, _ in labelled[: i + 1]], skip_special_tokens=True)
        if text.startswith(shown):
            piece, shown = text[len(shown) :], text
            if piece:
                yield piece, accepted


def _runs(pieces: Sequence[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Adjacent pieces with the same label joined."""
    runs: list[tuple[str, bool]] = []
    for text, kept in pieces:
        if runs and runs[-1][1] == kept:
            runs[-1] = (runs[-1][0] + text, kept)
        else:
            runs.append((text, kept))
    return runs


class ShowcaseView:
    """The showcase as a rich renderable: the prompt, then the completion and the truth side by side
    (stacked when the console is narrow); marks by colour, or by « » where there is none."""

    def __init__(self, showcase: Showcase, new_tokens: int, whole_prompt: bool = False) -> None:
        self.showcase = showcase
        self.new_tokens = new_tokens
        self.whole_prompt = whole_prompt  # an instruction, not a window cut mid-line

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        s = self.showcase
        colour = console.color_system is not None and not console.no_color
        completion = Text()
        for text, kept in _runs(s.pieces):
            if kept and not colour:
                completion.append(f"{OPEN_MARK}{text}{CLOSE_MARK}")
            else:
                completion.append(text, style=ACCEPTED_STYLE if kept else "")
        how = "green, underlined" if colour else f"between {OPEN_MARK} {CLOSE_MARK}"
        left = Panel(completion, title="greedy completion (speculative)", title_align="left")
        right = Panel(Text(s.truth), title="true continuation (held-out file)", title_align="left")
        if options.max_width >= 100:
            grid = Table.grid(expand=True, padding=(0, 1))
            grid.add_column(ratio=1)
            grid.add_column(ratio=1)
            grid.add_row(left, right)
            body: Any = grid
        else:
            body = Group(left, right)
        yield Panel(
            Text(s.prompt if self.whole_prompt else _from_line_start(s.prompt), style="dim"),
            title="a held-out prompt",
            title_align="left",
        )
        yield body
        yield Text(
            f"{s.tokens or self.new_tokens} greedy tokens, identical to the target's own; the draft's accepted "
            f"tokens ({s.accepted_share:.0%} of the text) {how}, the rest the target's",
            style="dim",
        )


def _from_line_start(prompt: str) -> str:
    """The prompt from its first whole line: a window of tokens usually starts mid-line."""
    _, newline, rest = prompt.partition("\n")
    return rest if newline and rest.strip() else prompt
