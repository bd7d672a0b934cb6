"""The README's zoo table is rendered from model cards and replaced between its markers only."""

from __future__ import annotations

import pytest

from fedge.zoo import ZooPaths
from fedge.zoo.table import END, START, render, replace_in


def test_table_comes_from_the_card_and_replaces_only_the_marked_block(micro_zoo: ZooPaths) -> None:
    card = micro_zoo.card
    table = render([micro_zoo.card_path])
    row = table.splitlines()[-1]
    assert row.startswith("| `micro` |")
    assert f"{card['target']['heldout_perplexity']:.1f}" in row
    assert f"{card['agreement']['greedy_rate']:.1%}" in row
    document = f"intro\n{START}\nold hand-typed row\n{END}\noutro\n"
    updated = replace_in(document, table)
    assert "old hand-typed row" not in updated
    assert updated.startswith("intro\n") and updated.endswith("\noutro\n") and row in updated


def test_document_without_markers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no table markers"):
        replace_in("# README without the table\n", "| x |")
