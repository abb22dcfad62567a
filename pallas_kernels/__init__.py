"""Pallas kernels: streamed QKV projection and attention over packed low-bit K/V."""
