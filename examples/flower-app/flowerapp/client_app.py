"""The ClientApp: Flower's quickstart shape, with fedge's TrainRound around the loop and fedge's
client mod (this node's privacy policy, SecAgg+ masking when the server runs SecAgg+)."""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.clients.mods import dispatch_mods
from fedge.strategies.client import TrainRound
from flowerapp.task import Net, evaluate, load_data, train

app = ClientApp(mods=[dispatch_mods])  # a no-op under Flower's FedAvg and fedge's bare strategies


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model on this node's data and reply (Flower's or fedge's shape)."""
    net = Net()
    fl = TrainRound.start(msg, context, net)  # loads the global arrays into net
    x, y = load_data(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    steps, lr = (
        int(context.run_config.get("local-steps", 10)),
        float(context.run_config.get("lr", 0.05)),
    )
    loss = train(net, fl, x, y, steps, lr)
    return fl.reply(num_examples=len(x), local_steps=steps, lr=lr, metrics={"train-loss": loss})


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on this node's data."""
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    loss, accuracy = evaluate(net, x, y)
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": accuracy, "num-examples": len(x)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
