"""Scenario files, device populations, network profiles and the simulation runner."""

from fedge.logs import route_to_flower

route_to_flower()  # fedge's log lines reach Flower's log (fedge/logs.py)
