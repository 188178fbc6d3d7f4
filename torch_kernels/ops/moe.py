"""The moe family (being written)."""

OPS = ()
