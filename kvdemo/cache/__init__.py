"""The KV cache itself, with no model run and no session: the one registry of backends (`registry`, the specs it
offers in `catalogue`), a backend and its options (`spec`, with its q_group_size rules in `groups`, its byte formulas
in `layouts`, a per-layer `layer_plan` and the words of the text options in `policies`), what each kind of model
layer gets (`layer_kinds`) and what it stores (`geometry`), taking and restoring the post-prefill state
(`snapshot`), a cache as plain tensors and a manifest (`serialize`), the real memory and flushes read from a cache
(`telemetry`), the out-of-memory guard (`budget`), a decode step's speed limit (`speedlimit`) and the backends'
one-off warm-up (`warmup`); the cache layers themselves are in `kvdemo.cache.layers`. It imports from no other kvdemo
package but `kvdemo.checks` (docs/DESIGN.md, "The package order")."""
