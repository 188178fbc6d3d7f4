"""The paged KV cache: ``reshape_and_cache_flash``, ``rotary_embedding_and_cache``."""
