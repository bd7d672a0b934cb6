"""Aggregation strategies (FedAvg, FedProx, SCAFFOLD): pure math plus the client hooks they need."""
