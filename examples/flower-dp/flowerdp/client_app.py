"""The ClientApp: Flower's quickstart loop, fedge's TrainRound around it, and DP-SGD on demand."""

from __future__ import annotations

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.clients.mods import dispatch_mods
from fedge.clients.privacy.private import make_private
from fedge.strategies.client import TrainRound
from flowerdp.task import Net, evaluate, load_data, train

app = ClientApp(mods=[dispatch_mods])  # the node's policy; clip + noise + mask under SecAgg+ DP


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model on this node's data; privately when the run asks for DP-SGD."""
    cfg, node = context.run_config, context.node_config
    net = Net()
    fl = TrainRound.start(msg, context, net)  # loads the global arrays into net
    data = load_data(int(node["partition-id"]), int(node["num-partitions"]))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    lr, epochs = float(cfg.get("lr", 0.1)), int(cfg.get("epochs", 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    metrics = {}
    if cfg.get("privacy") == "dp-sgd":  # sample-level DP: the same loop on private stand-ins
        with make_private(
            net,
            optimizer,
            loader,
            context=context,
            fl=fl,
            noise_multiplier=float(cfg.get("noise-multiplier", 1.0)),
            max_grad_norm=float(cfg.get("clip", 1.0)),
        ) as dp:
            loss = train(dp.model, dp.optimizer, dp.data_loader, epochs)
        metrics["dp-sgd-epsilon"] = dp.epsilon  # this client's, over every round it trained
    else:
        loss = train(net, optimizer, loader, epochs)
    steps = epochs * len(loader)
    return fl.reply(
        num_examples=len(data), local_steps=steps, lr=lr, metrics={"train-loss": loss, **metrics}
    )


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on this node's data."""
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = load_data(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    loss, accuracy = evaluate(net, data)
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": accuracy, "num-examples": len(data)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
