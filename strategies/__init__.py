"""Aggregation strategies (FedAvg, FedProx, SCAFFOLD): pure math plus the client hooks they need."""

from fedge.logs import route_to_flower

route_to_flower()  # fedge's log lines reach Flower's log (fedge/logs.py)
