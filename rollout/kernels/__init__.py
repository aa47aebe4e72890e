"""Kernels: the C++ CPU kernels (`csrc/`, built and loaded by `cpu_kernels`), the routed oneDNN / small-M
linears and the fused Llama-family layers."""
