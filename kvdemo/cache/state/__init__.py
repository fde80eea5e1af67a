"""The live cache's state: the post-prefill snapshot and its restore (`snapshot`), a cache as plain tensors and a
manifest for a session file (`serialize`), its real memory and flushes (`telemetry`), the out-of-memory guard
(`budget`) and a decode step's speed limit (`speedlimit`)."""
