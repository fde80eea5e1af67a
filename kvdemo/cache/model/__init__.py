"""What a model's config says the cache holds, with no cache built: each layer's stored shapes (`geometry`), what each
kind of layer gets (`layer_kinds`), which q_group_size fits the stored widths (`groups`) and a spec's checks against one
model (`model_checks`)."""
