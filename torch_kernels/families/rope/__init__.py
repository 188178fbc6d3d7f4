"""Rotary position embedding: ``rotary_embedding``, ``qk_rmsnorm_rope``."""
