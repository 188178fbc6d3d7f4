"""The sampling family's inventory: who implements which op, and how each op compiles."""

from ...manifest import kernels, reference
from ...spec import DECOMPOSE, INDUCTOR_TRITON, OPAQUE, Backend, Family, OpInfo

PROBS_OPS = ("top_k_renorm_probs", "top_p_renorm_probs", "top_k_top_p_sampling_from_probs")
LOGITS_OPS = ("softmax", "top_k_mask_logits")
OPS = PROBS_OPS + LOGITS_OPS + ("min_p_sampling_from_probs",)
SPECULATIVE_OPS = ("chain_speculative_sampling",)
LOGITS_IN_OPS = ("sampling_from_probs", "sampling_from_logits", "top_k_top_p_sampling_from_logits")
OPS = OPS + SPECULATIVE_OPS + LOGITS_IN_OPS + ("sampled_token_logprobs",)

_NO_ROUTE = (
    (DECOMPOSE, "the reference sorts the vocabulary; torch.compile of it failed in Inductor (SplitScan codegen on "
                "the int64 cumsum)"),
    (INDUCTOR_TRITON, "its Triton kernel has no launch through wrap_triton"),
)

FAMILY = Family(
    __package__,
    ops=(*(OpInfo(op, OPAQUE, no_compile_route=_NO_ROUTE) for op in PROBS_OPS),
         OpInfo("softmax", OPAQUE, no_compile_route=(
             (DECOMPOSE, "opaque as the family's other ops until Inductor's softmax is measured beside the kernel"),
             (INDUCTOR_TRITON, "its Triton kernel has no launch through wrap_triton"))),
         OpInfo("top_k_mask_logits", OPAQUE, no_compile_route=(
             (DECOMPOSE, "the reference sorts each row to find its k-th largest logit"),
             (INDUCTOR_TRITON, "its Triton kernel has no launch through wrap_triton"))),
         OpInfo("min_p_sampling_from_probs", OPAQUE, no_compile_route=(
             (DECOMPOSE, "its draw is the family's int64 cumsum, on which Inductor failed for "
                         "top_k_top_p_sampling_from_probs (SplitScan codegen)"),
             (INDUCTOR_TRITON, "its Triton kernel has no launch through wrap_triton"))),
         OpInfo("chain_speculative_sampling", OPAQUE, no_compile_route=(
             (DECOMPOSE, "its residual draw is the family's int64 cumsum, on which Inductor failed for "
                         "top_k_top_p_sampling_from_probs (SplitScan codegen)"),
             (INDUCTOR_TRITON, "its Triton kernel has no launch through wrap_triton"))),
         *(OpInfo(op, OPAQUE, no_compile_route=(
             (DECOMPOSE, "its draw is the family's int64 cumsum, on which Inductor failed for "
                         "top_k_top_p_sampling_from_probs (SplitScan codegen)"),
             (INDUCTOR_TRITON, "its Triton kernel has no launch through wrap_triton"))) for op in LOGITS_IN_OPS),
         OpInfo("sampled_token_logprobs", OPAQUE, no_compile_route=(
             (DECOMPOSE, "opaque as softmax until Inductor's log_softmax and gather are measured beside the kernel"),
             (INDUCTOR_TRITON, "its Triton kernel has no launch through wrap_triton")))),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, PROBS_OPS,
                 "one program per row: candidate buffer in one read (top_k <= 1024), else multi-pivot passes; "
                 "bit-exact with the reference", ("float32", "float16", "bfloat16"),
                 out_ops=("top_k_renorm_probs", "top_p_renorm_probs")),
        *kernels(__package__, Backend.TRITON, LOGITS_OPS,
                 "softmax: a program per slice of 4096 values, its max and sum online, then each slice written with "
                 "the row's; top-k mask by a radix select over order keys, exact", ("float32", "float16", "bfloat16"),
                 out_ops=LOGITS_OPS),
        *kernels(__package__, Backend.TRITON, ("min_p_sampling_from_probs",),
                 "each slice's max, then its kept mass, a program a slice; the draw in the slice that holds it; "
                 "bit-exact with the reference",
                 ("float32", "float16", "bfloat16")),
        # FlashInfer decides the top-p boundary in fp32 (a token within ~1e-6 of it may go either way)
        *kernels(__package__, Backend.FLASHINFER, ("top_k_top_p_sampling_from_probs",),
                 "top_k_renorm_probs + top_p_sampling_from_probs: same kept set, FlashInfer's random stream",
                 ("float32", "float16", "bfloat16"), checks=True, own_random_stream=True),
        *kernels(__package__, Backend.TRITON, SPECULATIVE_OPS,
                 "one program per row for the acceptance tests, then the residual or bonus row by slices (max and "
                 "mass in one read) and the draw in one slice; bit-exact with the reference", ("float32",)),
        *kernels(__package__, Backend.TRITON, ("sampling_from_probs",),
                 "one read: each slice's max and mass at 1.0's scale, a program a slice; the draw in one slice; "
                 "bit-exact with the reference", ("float32", "float16", "bfloat16")),
        *kernels(__package__, Backend.TRITON, ("sampling_from_logits",),
                 "softmax's slice statistics, each slice's mass, then one program per row drawing in the slice "
                 "that holds it; probabilities recomputed in registers (none written); the ids of Triton softmax "
                 "then sampling_from_probs",
                 ("float32", "float16", "bfloat16")),
        *kernels(__package__, Backend.TRITON, ("top_k_top_p_sampling_from_logits",),
                 "the probs-in kernels with the split prepass computing each probability from the logits (after "
                 "softmax's slice statistics); probabilities written only for rows it does not finish; a scalar "
                 "top-k off or past the prepass's slots, or the joint order: Triton softmax then the probs-in kernels",
                 ("float32", "float16", "bfloat16")),
        *kernels(__package__, Backend.TRITON, ("sampled_token_logprobs",),
                 "softmax's slice statistics, then one program per row counting the values at or above the "
                 "token's; no log-probabilities tensor", ("float32", "float16", "bfloat16")),
    ),
)
