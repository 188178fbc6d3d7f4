"""Launch parameters of the sampling kernels: one frozen record, passed to ``_launch`` and from there to
every kernel's launch; sweeps pass their own (``benchmarks/bench_sampling.py --sweep``,
``--prepass-sweep``). The figures behind the defaults are in ``docs/design/sampling.md``."""

from typing import NamedTuple

import triton


class Config(NamedTuple):
    """Launch parameters (powers of two; ``k_small <= cap``, ``slices <= cap``). The one-program routes
    are sized by register budget: 108 registers a thread at 16 warps for sm_90, no spills."""
    cap: int = 4096  # candidate buffer slots per row (int32 bits + int32 index)
    chunk: int = 4096  # elements per step of the streaming candidate pass
    k_small: int = 1024  # the candidate route takes 0 < top_k <= k_small
    chunk_g: int = 2048  # elements per step of the full-pass searches
    np_count: int = 16  # pivots per pass of the top-k count search (log2(17) = 4.1 bits a pass)
    np_mass: int = 8  # pivots per pass of the exact top-p mass search (int64 sums: fewer, 3.2 bits a pass)
    np_float: int = 8  # pivots per pass of the fp32 top-p search: [chunk_g, 8] fp32 + int32 accumulators, 64 registers
    num_warps: int = 16  # one program per row: 64 rows fill half the H200's SMs, so wide programs
    # split prepass (V > cap with top-k given; 0 slices: none). cap // slices slots a slice (128): a row
    # can split only when top_k <= min(cap // slices, k_small)
    slices: int = 32  # slices per row: 4008 values a slice at V = 128256; 16 slices: 90.6 against 87.5 µs at 64 rows
    np_slice: int = 16  # pivots per round of a slice's count search ([16, 4096] compares per round)
    # values a group of the slice's group maxima, where its count search starts (0: none); larger groups
    # leave ~k (1 + k / groups) values above their k-th largest: 16 took 85.2 µs at 64 rows, 8 took 87.5
    slice_group: int = 16
    slice_warps: int = 8  # a slice program: 16 values a thread, 80 registers; 4 warps (180): 102.7 against 87.5 µs
    # ptxas .maxnreg of a slice program (0: its choice): 64 fits 4 programs of 8 warps an SM instead of
    # 3, 2 waves instead of 3 for 32 rows' 1024 programs: 71.7 against 85.2 µs at 64 rows
    slice_maxnreg: int = 64
    # the renormalised row's write (_renorm_write_kernel, grid (B, cdiv(V, write_block))): 16 values a
    # thread at 8 warps, four 16-byte loads and stores in flight; 2048 programs at 64 rows of 128256
    write_block: int = 4096
    write_warps: int = 8
    # the histogram route (top-p rows that top-k leaves whole, V > cap; 0 slices: none)
    # the most slices a row of the histogram kernels (4000 values at V = 256000): at 32 slices of 8000,
    # _hist_kernel took 228 registers a thread for sm_90 against 110 at 4096 (1 program an SM, not 2)
    hist_slices: int = 64
    # a power of two >= 4 (2 lumps), 24 KB a row: over a 2-octave window a fine bucket is 1/512 octave,
    # ~5 values at the threshold of a softmax of randn * 3 at p = 0.9: one compaction, 14 bisection steps
    hist_buckets: int = 2048
    # levels: 8 x 2 octaves reach ~16 octaves below the largest value, where p <= 0.95 puts the
    # threshold of softmax(randn * s) rows; a level costs 3 instructions a value in the prepass
    hist_levels: int = 8
    hist_level_octaves: int = 2
    hist_warps: int = 8  # a slice program: 16 values a thread, as the slice prepass
    # ptxas .maxnreg of _hist_kernel (0: its choice, 110 for sm_90: 2 programs an SM); 80 fits 3 with
    # 40 bytes of spill: top_p_renorm_probs 337 against 375 µs at 512 x 32000, 524 against 531 at 256 x 128256
    hist_maxnreg: int = 80
    # sampling calls too (rows with top_k <= 0 or >= V): the four launches cost the top_k=50 call
    # 119 against 101 µs at 64 rows, and top-p-only sampling rows take the full-pass route instead
    hist_with_top_k: bool = False
    # a call's slices a row (`slices`, `hist_slices` at most; 0: always those): enough to keep a slice
    # within slice_values, else `slices` or fewer where the batch alone fills fill_programs: a program's
    # cost is mostly fixed (top_k_renorm_probs took 153 µs at 256 x 32000, 1000 values a slice, and 257
    # at 256 x 128256, 4008), and an H200's 132 SMs hold 4 slice programs each
    slice_values: int = 4096
    fill_programs: int = 528
    # the histogram route's fewest slices a row: 32 slices of 1000 values took top_p_renorm_probs 173
    # against 187 µs at 256 x 32000 (8 slices) and 349 against 375 at 512; 55.8 against 58.5 at 64 (16)
    hist_min_slices: int = 32


def fitted(config: Config, rows: int, V: int) -> Config:
    """``config`` with the slices a row of a call of ``rows`` rows of ``V`` values takes (``slice_values``)."""
    if not config.slice_values or rows <= 0:
        return config
    by_fill = min(config.slices, triton.next_power_of_2(triton.cdiv(config.fill_programs, rows)))
    want = max(triton.next_power_of_2(triton.cdiv(V, config.slice_values)), by_fill)
    return config._replace(slices=min(config.slices, want),
                           hist_slices=min(config.hist_slices, max(want, config.hist_min_slices)))


def k_split(config: Config) -> int:
    """The largest top-k a row can split at: a slice's slots (``cap // slices``), within ``k_small``."""
    return min(config.cap // config.slices, config.k_small)


DEFAULT = Config()
