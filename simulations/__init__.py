"""Scenario files, device populations, network profiles and the simulation runner."""
