"""The KV cache itself, with no model run and no session, as rooms a newcomer can read from the top down:

- the spec's front: a format's card (`backend.Backend`), the one registry of formats (`registry`), a spec of one
  format and its options (`spec.CacheSpec`), the specs kvdemo offers (`catalogue`), the option type and the order
  they are shown in (`options`), the words of the text options (`policies`), the shared byte formulas of the
  group-wise formats (`layouts`), a per-layer plan (`layer_plan`), the deploy lines (`deploy`) and the formats'
  one-off warm-up (`warmup`);
- `formats`: one folder per format, everything kvdemo knows of it (its card, layers, blocks, codes, store types);
- `layers`: the layer mixins every format shares (flush policies, rotation, K/V precision, sliding windows, float8
  arithmetic, the cache built by layer kind, `dynamic`'s growing storage), the block-wise read and kvdemo's attention
  function;
- `read`: the decode kernel over the stored codes and the build of kvdemo's C kernels (it imports no other room);
- `model`: what a model's config says the cache holds (geometry, layer kinds, q_group_size against the shapes, a
  spec's checks on a model);
- `state`: the live cache's state (the post-prefill snapshot, a cache as a file, its real memory, the out-of-memory
  guard, a decode step's speed limit).

It imports from no other kvdemo package but `kvdemo.checks` and `kvdemo.paths` (docs/DESIGN.md, "The package order";
the order of the rooms is `tests/test_layout.py`'s `CACHE_ROOMS`)."""
