"""Tensor parallelism: ``all_reduce_fused_add_rmsnorm``, ``all_reduce_fused_add_rmsnorm_fp8_quant``."""
