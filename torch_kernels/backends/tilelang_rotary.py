"""The rotation of a pair ``(x1, x2)`` by ``(cos, sin)`` in the TileLang kernels of several families
(the rope family's ``rotary_embedding`` and ``qk_rmsnorm_rope``, the KV-cache family's fused cache
write), in fp32 operations each rounded: nvcc contracts ``a * b - c * d`` into a multiply-add on
either product as the surrounding code schedules it, which left the fused kernels one fp32 ulp from
``rotary_embedding`` (8 of 64 values of a head). Rounded, every kernel turns a pair to the same bits."""

import tilelang.language as T


def turned_first(x1, x2, cos, sin):
    """``x1 * cos - x2 * sin``, each product and the difference rounded to fp32."""
    return T.ieee_sub(T.ieee_mul(x1, cos), T.ieee_mul(x2, sin))


def turned_second(x1, x2, cos, sin):
    """``x2 * cos + x1 * sin``, each product and the sum rounded to fp32."""
    return T.ieee_add(T.ieee_mul(x2, cos), T.ieee_mul(x1, sin))
