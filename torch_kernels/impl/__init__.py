"""Implementations: ``torch/`` is the reference; the other folders are the backends, imported lazily."""
