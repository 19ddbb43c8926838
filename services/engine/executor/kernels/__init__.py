"""Decode attention kernels for the engine: Triton on CUDA (with a plain-torch reference of the same
interface) and C++ on a CPU (built at first use), each reading K/V in place through block tables."""
