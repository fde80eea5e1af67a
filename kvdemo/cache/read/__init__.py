"""The decode read path: kvdemo's attention function (`attention`: the query side of a rotated cache, which path each
layer takes, `decode_read`), the block-wise read of a quantized store (`blockwise`), decode attention over the stored
codes (`code_attention`, its C kernel `code_attention.c` with llama.cpp's block arithmetic `ggml_dequant.c`) and the
one-per-machine build of kvdemo's C kernels (`c_build`). A format hands this path its store as codes
(`code_attention.StoreCodes`, from its layer's `_codes_of`), or none."""
