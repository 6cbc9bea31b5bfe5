"""Triton kernels behind `quire.attention.triton_backend`: one module per kernel family.

`@triton.jit` picks the compiler or the CPU interpreter when a kernel is defined, i.e. when
these modules are first imported: TRITON_INTERPRET=1 must be set by then to run on the CPU.
"""
