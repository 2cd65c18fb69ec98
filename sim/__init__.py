"""``kvserving simulate``: the cluster simulator (the gateway's real router and lease
table over simulated prefill and decode workers) and the capacity planning on top."""
