"""The fedge ClientApp: LoRA fine-tuning of the cached base model on this node's partition.

Message handlers (Flower Message API):

* ``query``: reports this node's ``partition-id`` so the server can sample by
  partition (reproducible across restarts, where node ids change).
* ``train``: loads the global adapter into the cached model, runs the strategy's
  hooked local steps on the partition's train split, replies with the summable
  ``contribution`` ArrayRecord and a ``metrics`` MetricRecord.
* ``evaluate``: held-out loss of the global adapter on the partition's held-out split.

All configuration arrives in the message's ``config`` ConfigRecord; the node config
says which partition this node is (``partition-id``). Mods named by ``client-mods``
are applied per call by :func:`fedge.clients.mods.dispatch_mods`.

The train and evaluate work lives in :mod:`fedge.clients.rounds`, imported by the first such call:
loading this app and answering a query import no torch, transformers or peft (a process that
only reports its partition, as the Deployment Engine starts one per message, spent about 5 CPU
seconds importing them; about 0.5 s without).
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import keys
from fedge.clients.mods import dispatch_mods
from fedge.clients.node import partition_id

app = ClientApp(mods=[dispatch_mods])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition id."""
    metrics = MetricRecord({keys.MET_PARTITION: partition_id(context)})
    return Message(RecordDict({keys.REC_METRICS: metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run local LoRA training on this node's partition and reply with the contribution."""
    from fedge.clients import rounds  # the training stack loads here, never for a query

    return rounds.train_reply(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Held-out loss of the global adapter on this node's held-out split."""
    from fedge.clients import rounds  # the training stack loads here, never for a query

    return rounds.evaluate_reply(msg, context)
