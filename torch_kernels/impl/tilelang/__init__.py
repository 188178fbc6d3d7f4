"""TileLang backend: one module per op family (``norm.py``, ``activation.py``, ...), compiled through
``_jit.compiled`` (one kernel per specialisation, every token count; cached in memory and on disk)."""
