"""`python -m cli ...` runs the `fedge` command line (what child processes and tests start)."""

from cli.main import main

main()
