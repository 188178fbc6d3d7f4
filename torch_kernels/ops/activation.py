"""The activation family (being written)."""

OPS = ()
