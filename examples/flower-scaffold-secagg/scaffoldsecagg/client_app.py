"""The ClientApp: TrainRound around the loop, and fedge's mod, which masks the reply under SecAgg+."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedge.clients.mods import dispatch_mods
from fedge.strategies.client import TrainRound
from scaffoldsecagg.task import load_data, make_net, train

app = ClientApp(mods=[dispatch_mods])


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train on this node's data; reply with SCAFFOLD's contribution (masked by the mod)."""
    net = make_net()
    fl = TrainRound.start(msg, context, net)  # c_i lives in context.state, committed on acceptance
    x, y = load_data(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    steps, lr = int(context.run_config["local-steps"]), float(context.run_config["lr"])
    train(net, fl, x, y, steps, lr)
    return fl.reply(num_examples=len(x), local_steps=steps, lr=lr)
