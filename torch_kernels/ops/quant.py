"""The quant family (being written)."""

OPS = ()
