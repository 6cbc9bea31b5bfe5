"""Native CPU kernels in plain C++, built on first use and called through ctypes: the
builder and loader (loader.py), the weight-only quantized matmul (quant_matmul.cpp and its
wrapper quant_matmul.py), the fused element-wise ops of a decoder layer (fused_ops.cpp,
wrapped by quire.native.fused_ops), the whole-step decode stack (decode_stack.cpp, wrapped by
quire.native.decode_stack), the paged attention kernel (paged_decode.cpp, wrapped by
quire.native.paged_attention), the oneDNN-packed linear (packed_linear.py) and the headers
they share (bf16.h). The floor below attention, layers and models: it imports none of them."""
