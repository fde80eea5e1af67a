"""The cache layers every format shares, each a subclass or mixin of a transformers cache layer, and the attention
function that reads them: a quantized format's cache built layer by layer from the model's layer kinds (`by_kind`),
the flush policies and the residual formats' layer families (`flush`), quantized sliding-window layers (`sliding`),
layers that code each token as it is written and append it (`appended`), rotated keys and values (`rotation`), the
values' own bits (`precision`), float8 codes read by bit placement (`float8`), how `dynamic` grows its tensors
(`storage`), the block-wise read of a quantized store (`blockwise`: each block from its codes through
`kvdemo.cache.read`, or de-quantized) and kvdemo's attention function (`attention`: the query side of a rotated
cache, which path each layer takes, `decode_read`). A format's own layers are in its folder (`kvdemo.cache.formats`);
what a spec allows is decided above, in `kvdemo.cache.spec`."""
