"""Prefill/decode disaggregation: engines in the prefill or decode role hand KV blocks
over through a KVConnector (connector.py) under leases (transfer.py), and `infire
balance` (balancer.py) splits each request into its two legs."""
