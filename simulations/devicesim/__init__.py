"""Simulated devices: a population table, a virtual clock, deadlines, churn and memory fit.

Device simulation wraps the Grid the ServerApp talks to (:class:`.grid.DeviceGrid`); the
ClientApp deployed on a real device carries none of it. Layout:

* :mod:`.tiers`: built-in device tiers with sourced figures (docs/phones.md cites them);
* :mod:`.population`: the device table as compact numpy arrays, loaders and validation;
* :mod:`.workload`: FLOPs, bytes and peak memory of one client's local training;
* :mod:`.clock`: the pure virtual-clock arithmetic of one exchange (deadline, first K);
* :mod:`.grid`: the Grid wrapper that applies the clock to real messages;
* :mod:`.report`: per-round and per-device reports, time to target, plots.
"""
