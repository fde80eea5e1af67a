"""The cache layers kvdemo builds on transformers' own: a quantized backend's cache built layer by layer from the
model's layer kinds (`by_kind`), the flush policies (`flush`), quantized sliding-window layers (`sliding`), rotated
keys and values (`rotation`) with the attention function that rotates the query (`attention`) and reads a store
block by block (`blockwise`), the libraries' de-quantization in place (`dequantize`, `fp8`), the values' own bits
(`precision`), hqq's optimiser switch (`hqq_optimize`) and how `dynamic` grows its tensors (`storage`). Every layer
here is a subclass of a transformers cache layer; what a spec allows is decided above, in `kvdemo.cache.spec`."""
