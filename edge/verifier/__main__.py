"""`python -m edge.verifier --model DIR ...`: `fedge verifier serve` alone, for processes hosting only it."""

import typer

from edge.cli import serve_command

typer.run(serve_command)
