"""`python -m fedge.edge.verifier --model DIR ...`: `fedge verifier serve` alone, for processes hosting only it."""

import typer

from fedge.edge.cli import serve_command

typer.run(serve_command)
