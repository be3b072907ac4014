"""Block-sparse attention math: Triton kernel, CPU path, dense reference."""
