"""MoE routing: ``topk_softmax``, ``grouped_topk``."""
