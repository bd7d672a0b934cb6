"""A robust aggregation rule, sized for the attackers it must survive, in a Flower quickstart app."""
