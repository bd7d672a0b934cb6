"""Server-side held-out evaluation: whole corpus, participants only, and participants with no text."""

from __future__ import annotations

import math

from fedge.lm import holder
from server.config import RunConfig
from server.loop import ServerModel


def test_participants_without_heldout_text_score_nan_not_crash(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """No participant held-out text (none known yet, or none in their packages): NaN, the run goes on."""
    cfg = RunConfig.from_mapping({"model": str(micro_zoo.target_dir), "server-eval-batches": 2})
    model = ServerModel(cfg)
    corpus = holder.get_corpus(model.client_config)
    with_text = [i for i in range(len(corpus)) if len(corpus.client(i).heldout) > 200]
    adapter = model.initial_adapter()
    assert math.isnan(model.evaluate(adapter, []))
    assert math.isfinite(model.evaluate(adapter, with_text[:2]))
    assert math.isfinite(model.evaluate(adapter))  # the whole corpus
