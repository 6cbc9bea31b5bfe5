"""Native CPU kernels in plain C++, built on first use and called through ctypes: the
builder and loader (loader.py), the weight-only quantized matmul (quant_matmul.cpp and its
wrapper quant_matmul.py), the fused element-wise ops of a decoder layer (fused_ops.cpp,
wrapped by quire.models.fused_ops), the whole-step decode stack (decode_stack.cpp, wrapped by
quire.models.decode_stack) and the headers they share (bf16.h). The paged attention kernel
lives with attention (quire.attention.cpu_kernels) and is built by the same loader."""
