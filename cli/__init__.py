"""The top floor: the `fedge` command line and the demo's composition of every layer below."""
