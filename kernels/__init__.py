"""Fused Triton kernels for Llama training."""
