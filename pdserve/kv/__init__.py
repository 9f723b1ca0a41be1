"""The KV cache as bytes: its layout (block-major, torch-free), the shared-memory segment, the torch view of
the cache, and transfer plans (which byte ranges go where)."""
