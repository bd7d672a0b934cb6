"""A baseline ClientApp that rebuilds the model inside every ``train`` call, as Flower's LLM examples do.

It exists only so ``bench/fl_throughput.py`` can measure, in the same run, what the
per-worker model cache of :mod:`fedge.clients.app` saves. Training, data and the reply
are those of :mod:`fedge.clients.app`; the only difference is that the base model and
its LoRA wrapper are loaded from disk on each call and dropped afterwards.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedge.clients import app as cached_app
from fedge.lm import holder

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Same as the cached app."""
    return cached_app.query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Drop every cached model first, so the call loads base + LoRA from disk like the examples."""
    holder.drop_models()
    return cached_app.train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate also rebuilds the model."""
    holder.drop_models()
    return cached_app.evaluate(msg, context)
