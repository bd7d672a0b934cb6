"""The ClientApp: Flower's quickstart shape, unchanged; the first `attackers` partitions poison."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from robustapp.task import load_data, make_net, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train on this node's data and reply; an attacker sends -10x its update instead."""
    net = make_net()
    start = msg.content["arrays"].to_torch_state_dict()
    net.load_state_dict(start)
    partition = int(context.node_config["partition-id"])
    x, y = load_data(partition, int(context.node_config["num-partitions"]))
    train(net, x, y, int(context.run_config["local-steps"]), float(context.run_config["lr"]))
    trained = net.state_dict()
    if partition < int(context.run_config["attackers"]):  # the demo's Byzantine clients
        trained = {k: start[k] - 10 * (v - start[k]) for k, v in trained.items()}
    metrics = MetricRecord({"num-examples": len(x)})
    return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=msg)
