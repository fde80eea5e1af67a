"""The cache layers every format shares, each a subclass or mixin of a transformers cache layer: a quantized format's
cache built layer by layer from the model's layer kinds (`by_kind`), the flush policies and the residual formats'
layer families (`flush`), quantized sliding-window layers (`sliding`), rotated keys and values (`rotation`), the
values' own bits (`precision`), float8 codes read by bit placement (`float8`) and how `dynamic` grows its tensors
(`storage`). A format's own layers are in its folder (`kvdemo.cache.formats`); what a spec allows is decided above, in
`kvdemo.cache.spec`."""
