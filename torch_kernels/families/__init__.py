"""The op families, one package each: ``manifest.py`` (which backend implements which op, how each op
compiles; standard library only), ``ops.py`` (the op definitions), ``reference.py`` (the torch
reference) and one module per backend that has kernels for the family. ``registry.py`` lists every
package here that has a manifest; see ``docs/extending.md``."""

#: the order in which the inventory, the self-check and docs/ops.md list the families; a family not
#: named here comes after these, by name
ORDER = ("norm", "activation", "rope", "kv_cache", "quant", "moe", "attention", "sampling", "collective")
