"""Rotary position embedding: ``rotary_embedding``."""
