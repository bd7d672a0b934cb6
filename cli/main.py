"""The `fedge` command line: one root Typer app that each part registers its commands on."""

from __future__ import annotations

import typer

from fedge.extras import check_installed

app = typer.Typer(
    name="fedge",
    help="Federated LoRA fine-tuning on Flower and edge-cloud speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _register_subcommands() -> None:
    """Attach each part's command group; imports stay here so `fedge --help` stays one place."""
    # The command line drives every part: on a core install (`pip install fedge`, the library
    # a Flower app imports) say which extras it needs rather than a bare ModuleNotFoundError.
    for package, extra in (("transformers", "lora"), ("onnxruntime", "edge"), ("ray", "fleet")):
        check_installed(package, "all", f"the fedge command line (its {extra} commands)")
    from fedge.cli.demo import demo
    from fedge.cli.privacy_init import privacy_init
    from fedge.edge.cli import edge_app, verifier_app
    from fedge.edge.fleet.cli import register as register_fleet
    from fedge.server.privacy.cli import app as privacy_app
    from fedge.simulations.cli import app as simulate_app
    from fedge.zoo.cli import app as models_app

    app.add_typer(models_app, name="models")
    app.add_typer(edge_app, name="edge")
    register_fleet(verifier_app)
    app.add_typer(verifier_app, name="verifier")
    app.add_typer(simulate_app, name="simulate")
    privacy_app.command("init")(privacy_init)
    app.add_typer(privacy_app, name="privacy")
    app.command("demo")(demo)


_register_subcommands()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
