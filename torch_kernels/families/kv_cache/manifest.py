"""The kv_cache family's inventory: who implements which op, and how each op compiles."""

from ...manifest import kernels, reference
from ...spec import OPAQUE, Backend, Family, OpInfo

OPS = ("reshape_and_cache_flash", "rotary_embedding_and_cache")
TRITON_OPS = OPS
TILELANG_OPS = OPS

FAMILY = Family(
    __package__,
    # opaque: the op writes a few rows of a cache that may hold gigabytes; a functional decomposition
    # would hand Inductor the whole cache to copy back
    ops=(OpInfo("reshape_and_cache_flash", OPAQUE,
                cuda_priority=(Backend.TRITON, Backend.TILELANG, Backend.TORCH)),
         OpInfo("rotary_embedding_and_cache", OPAQUE,
                cuda_priority=(Backend.TRITON, Backend.TILELANG, Backend.TORCH))),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, TRITON_OPS,
                 "one program per (token, chunk of heads; rope: of query heads, or of key and value heads); slots outside "
                 "the cache masked; e4m3 by div_rn and satfinite cvt"),
        *kernels(__package__, Backend.TILELANG, TILELANG_OPS,
                 "a thread per (token, 16-byte vector of a head), the token's heads in rounds (rope: the rotary kernel's "
                 "lanes of pairs over query then key heads); slots outside the cache read and write nothing; e4m3 by "
                 "__fdiv_rn and satfinite cvt; every stride (misaligned views value by value)"),
    ),
    notes=("FlashInfer's append_paged_kv_cache is a benchmark peer of reshape_and_cache_flash, not an implementation: "
           "it takes request-relative positions and page tables instead of slots, has no -1 padding (a padded token "
           "would be written) and casts to an fp8 cache without k_scale/v_scale; with apply_rope_with_cos_sin_cache_inplace "
           "before it, the same is rotary_embedding_and_cache's peer",),
)
