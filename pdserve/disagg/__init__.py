"""Prefill/decode disaggregation: the KV layout of a transfer, the transports, the cache messager,
the engine-side connector (control plane) and the startup truth table."""
