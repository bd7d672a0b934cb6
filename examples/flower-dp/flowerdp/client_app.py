"""The ClientApp: Flower's quickstart loop, fedge's TrainRound around it, and DP-SGD on demand."""

from __future__ import annotations

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedge.clients.mods import dispatch_mods
from fedge.clients.privacy.private import make_private
from fedge.strategies.client import TrainRound
from flowerdp.task import Net, load_data, train

app = ClientApp(mods=[dispatch_mods])  # the node's policy; clip, noise and mask under SecAgg+ DP


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model on this node's data; privately when the run asks for DP-SGD."""
    cfg, node = context.run_config, context.node_config
    net = Net()
    fl = TrainRound.start(msg, context, net)  # loads the global arrays into net
    data = load_data(int(node["partition-id"]), int(node["num-partitions"]))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    lr, epochs = float(cfg["lr"]), int(cfg["epochs"])
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    metrics = {}
    if cfg["privacy"] == "dp-sgd":  # sample-level DP: the same loop on private stand-ins
        z, clip = float(cfg["noise-multiplier"]), float(cfg["clip"])
        with make_private(net, optimizer, loader, context=context, fl=fl,
                          noise_multiplier=z, max_grad_norm=clip) as dp:  # fmt: skip
            loss = train(dp.model, dp.optimizer, dp.data_loader, epochs)
        metrics["dp-sgd-epsilon"] = dp.epsilon  # this client's, over every round it trained in
    else:
        loss = train(net, optimizer, loader, epochs)
    steps = epochs * len(loader)
    return fl.reply(len(data), steps, lr, metrics={"train-loss": loss, **metrics})
