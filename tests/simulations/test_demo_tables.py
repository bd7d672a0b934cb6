"""The demo's tables keep every column and figure at any console width, terminal or not.

Before `fedge.tables.wrapping_table`, a pipe's 80 columns cut the edge table's headers to
"tar…"/"clo…" and narrower consoles cut cells; these render each table to a plain (non-terminal)
console at several widths.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from fedge.edge.demo import _sample_panel, _table
from fedge.simulations.demo import FederationResult, acceptance_table, perplexity_table
from fedge.simulations.realign import ClientAcceptance


def render(renderable: object, width: int) -> str:
    """What a pipe or CI log of `width` columns receives."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(renderable)
    return buffer.getvalue()


def demo_tables() -> list[tuple[Table, list[str]]]:
    """Each table with the figures that must survive: headers' last column and every cell."""
    private = FederationResult(
        "SecAgg+ with distributed DP",
        Path("f"),
        Path("a"),
        Path("m"),
        [],
        6,
        61.41,
        62.92,
        70.37,
        76.45,
        25.9,
    )
    rows = [
        {
            "prompt": i,
            "tokens": 48,
            "acceptance": 0.37,
            "passes_per_token": 0.46,
            "tokens_per_s": 123.0,
            "cloud_tokens_per_s": 456.0,
            "identical_to_cloud_greedy": True,
        }
        for i in range(2)
    ]
    summary = {"acceptance": 0.37, "passes_per_token": 0.46, "draft_runtime": "onnx-int4"}
    acceptance = [
        ClientAcceptance(0, 0.575, 0.495, 0.647),
        ClientAcceptance(1, 0.5, 0.4, 0.6, prompt_tokens=12),
        ClientAcceptance(2, math.nan, math.nan, math.nan, prompt_tokens=0),
    ]
    return [
        (perplexity_table([private]), ["epsilon", "25.90", "76.45"]),
        (_table(rows, summary), ["= cloud", "456", "yes"]),
        (acceptance_table(acceptance), ["realigned", "64.7%", "n/a", "1 *"]),
    ]


@pytest.mark.parametrize("width", [80, 120])
def test_at_a_pipes_width_every_column_and_figure_is_whole(width: int) -> None:
    """At 80 columns (rich's width for a pipe) nothing is cut: no ellipsis, every figure intact."""
    for table, figures in demo_tables():
        text = render(table, width)
        assert "…" not in text
        assert all(len(line) <= width for line in text.splitlines())
        for figure in figures:
            assert figure in text, (figure, text)


def test_at_a_narrow_width_the_table_wraps_and_keeps_its_borders() -> None:
    """At 40 columns cells fold onto more lines; each body line still has all its column borders."""
    for table, _ in demo_tables():
        text = render(table, 40)
        assert "…" not in text
        body = [line for line in text.splitlines() if line.startswith("│")]
        assert body and all(line.count("│") == len(table.columns) + 1 for line in body), text


def test_acceptance_table_has_one_row_per_client_the_federation_ran() -> None:
    """A client too short to measure still gets a row, so the count matches the federation's."""
    table, _ = demo_tables()[2]
    assert table.row_count == 3 + 1  # three clients and the mean


def test_the_sample_panel_shows_prompt_and_completion_as_text() -> None:
    """The demo ends on readable code: the prompt and its sampled completion, both printed."""
    sample = {
        "temperature": 0.7,
        "prompt": "def parse(self, text):\n",
        "completion": "    return text.split()\n",
        "acceptance": 0.5,
    }
    text = render(_sample_panel(sample), 60)
    assert "def parse(self, text):" in text and "return text.split()" in text
    assert "temperature 0.7" in text
