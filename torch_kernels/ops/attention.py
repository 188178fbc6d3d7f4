"""The attention family (being written)."""

OPS = ()
