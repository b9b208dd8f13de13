"""Kernels for XLA:CPU in C++, called through the XLA FFI, each beside its reference.

XLA:CPU compiles most of the engine well; where it does not (int8 weights: it
converts the whole weight matrix to float before each dot), a kernel here does the
work, and the layers call it only on the CPU platform (`lax.platform_dependent`),
only once `library.load` has built and registered it.
"""
