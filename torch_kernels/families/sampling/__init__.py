"""Sampling: ``top_k_renorm_probs``, ``top_p_renorm_probs``, ``top_k_top_p_sampling_from_probs``, ``softmax``, ``top_k_mask_logits``,
``min_p_sampling_from_probs``, ``chain_speculative_sampling``, ``sampling_from_probs``, ``sampling_from_logits``,
``top_k_top_p_sampling_from_logits``, ``sampled_token_logprobs``."""
