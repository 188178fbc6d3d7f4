"""The rope family (being written)."""

OPS = ()
