"""Benchmarks callable from tasks: GEMM, collectives, kernels, training throughput."""
