"""The SecAgg+ protocol both sides speak: key agreement and Shamir shares, wire names, vector masking."""
