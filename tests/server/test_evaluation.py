"""Server-side held-out evaluation: whole corpus, participants only, and participants with no text."""

from __future__ import annotations

import math

import numpy as np

from fedge.lm import holder
from fedge.lm.evaluate import evaluate_tokens
from fedge.server.config import RunConfig
from fedge.server.loop import ServerModel


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


def test_participants_are_scored_on_their_own_heldout_text_only(micro_zoo) -> None:  # type: ignore[no-untyped-def]
    """The participants' loss is the loss on exactly their held-out streams, not the corpus'."""
    cfg = RunConfig.from_mapping({"model": str(micro_zoo.target_dir), "server-eval-batches": 2})
    model = ServerModel(cfg)
    corpus = holder.get_corpus(model.client_config)
    a, b = [i for i in range(len(corpus)) if len(corpus.client(i).heldout) > 200][1:3]
    adapter = model.initial_adapter()
    eval_cfg = type(cfg.train).from_config({**cfg.train.to_config(), "eval-batches": 2})

    def loss_on(*clients: int) -> float:
        tokens = np.concatenate([np.asarray(corpus.client(c).heldout) for c in clients])
        return evaluate_tokens(model.lm.model, tokens, eval_cfg, model.lm.device)[0]

    whole = model.evaluate(adapter)
    assert whole == loss_on(*range(len(corpus)))
    for participants in ([a], [a, b]):
        expected = loss_on(*participants)
        assert expected != whole  # the check can tell a participant score from the corpus'
        assert model.evaluate(adapter, participants) == expected


def test_client_eval_is_withheld_under_client_side_dp_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: under distributed DP fedge's loop asked the clients for their held-out loss
    every round (returned in clear on main). Now it asks none under DP-SGD or distributed DP
    (the clients would keep it home anyway), and still asks under plain, SecAgg+ and central DP."""
    from types import SimpleNamespace

    from fedge.server.loop import _client_eval_withheld
    from fedge.server.privacy.factories import central_dp, secagg, secagg_distributed_dp

    dp = {"weighting": "uniform", "dp-noise-multiplier": 0.8, "dp-clip-norm": 0.05}
    cases = {
        "plain": ({}, None),
        "secagg": ({}, secagg),
        "central-dp": (dp, central_dp),
        "distributed-dp": (dp, secagg_distributed_dp),
        "dp-sgd": ({"dp-sgd-noise-multiplier": 1.0}, None),
    }
    withheld = {}
    for name, (extra, factory) in cases.items():
        cfg = RunConfig.from_mapping({**extra, "run-dir": str(tmp_path / name)})
        fed = SimpleNamespace(cfg=cfg, aggregator=factory(cfg) if factory else None)
        withheld[name] = _client_eval_withheld(fed)  # type: ignore[arg-type]
    assert withheld == {
        "plain": False,
        "secagg": False,
        "central-dp": False,
        "distributed-dp": True,
        "dp-sgd": True,
    }
