"""Gated activations: ``silu_and_mul``, ``gelu_and_mul``, ``gelu_tanh_and_mul``."""
