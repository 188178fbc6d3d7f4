"""RMSNorm: ``rmsnorm``, ``fused_add_rmsnorm``, ``gemma_rmsnorm``, ``gemma_fused_add_rmsnorm``."""
