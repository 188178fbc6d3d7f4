"""Attention-state merge: ``merge_attn_states``."""
