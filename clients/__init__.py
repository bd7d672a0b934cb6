"""Flower ClientApp: LoRA trainer, per-worker model cache, secure-aggregation and DP client side."""

from fedge.logs import route_to_flower

route_to_flower()  # fedge's log lines reach Flower's log (fedge/logs.py)
