"""The decode kernel over the stored codes: decode attention that reads each block's codes a tile at a time
(`code_attention`, its C source `code_attention.c` with llama.cpp's block arithmetic `ggml_dequant.c`), and the
one-per-machine build of kvdemo's C kernels (`c_build`). It imports nothing else of `kvdemo.cache`: a format's layer
describes its store as codes (`code_attention.StoreCodes`, from the layer's `_codes_of`), and the block-wise read
(`kvdemo.cache.layers.blockwise`) hands the kernel those descriptors."""
