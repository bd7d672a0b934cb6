"""Flower ServerApp: round loop, evaluation, checkpoints, secure-aggregation and privacy server side."""

from fedge.logs import route_to_flower

route_to_flower()  # fedge's log lines reach Flower's log (fedge/logs.py)
