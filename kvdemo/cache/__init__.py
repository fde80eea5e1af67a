"""The KV cache itself, with no model run and no session: the one registry of backends (`registry`), a backend
and its options (`spec`), how `dynamic` stores its tensors (`storage`), the flush policies (`flush`), rotated keys
and values (`rotation`) with the attention function that rotates the query (`attention`), the words of those
options (`policies`), the geometry read from a model's config (`geometry`), taking and restoring the post-prefill
state (`snapshot`), the real memory and flushes read from a cache (`telemetry`), the out-of-memory guard (`budget`)
and a decode step's speed limit (`speedlimit`). It imports from no other kvdemo package but `kvdemo.checks`
(docs/DESIGN.md, "The package order")."""
