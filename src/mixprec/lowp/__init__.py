"""Low-precision GEMM layers."""
