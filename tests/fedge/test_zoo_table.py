"""The README's zoo table is rendered from model cards and replaced between its markers only."""

from __future__ import annotations

import pytest

from fedge.zoo import ZooPaths
from fedge.zoo.table import END, START, card_row, render, replace_in


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


def test_a_resumed_build_says_so_with_the_training_cpu_of_every_session() -> None:
    """A build resumed from checkpoints timed only its last session: the row must not pass
    that off as the build time (default's card: 2,527 CPU s in the last process, 3,274 trained)."""
    card = {
        "preset": "default",
        "tokenizer": {"vocab_size": 4096},
        "target": {
            "parameters": 5_795_072,
            "heldout_perplexity": 26.7,
            "training_cpu_seconds": 2025.0,
        },
        "draft": {
            "parameters": 2_163_968,
            "heldout_perplexity": 36.4,
            "training_cpu_seconds": 1249.3,
        },
        "agreement": {"greedy_rate": 0.7728, "tokens_per_verify_draft4": 3.017},
        "build_seconds": 2531.4,
        "build_cpu_seconds": 2527.4,
    }
    assert "2531 resumed (3274 training CPU s over all sessions)" in card_row(card)
    whole = {**card, "build_cpu_seconds": 3400.0}
    assert card_row(whole).endswith("| 2531 (3400) |")
