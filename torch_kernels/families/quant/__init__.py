"""FP8 quantisation: ``per_token_group_quant_fp8``."""
