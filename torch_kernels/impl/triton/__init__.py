"""Triton backend: one module per op family, holding the kernels, their launchers and heuristics."""
