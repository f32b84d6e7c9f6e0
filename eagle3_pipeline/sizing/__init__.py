"""--plan: disk, memory, KV cache and co-location of a run before it starts."""
