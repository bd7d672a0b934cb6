"""`python -m fedge.cli ...` runs the `fedge` command line (what child processes and tests start)."""

from fedge.cli.main import main

main()
