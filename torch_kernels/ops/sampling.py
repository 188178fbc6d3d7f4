"""The sampling family (being written)."""

OPS = ()
