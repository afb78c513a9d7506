"""The CUDA platform (platform.py): Triton kernels and the decode steps as CUDA graphs."""
