"""What a backend's kernels share across families: TileLang's compiler cache (``tilelang_jit``),
FlashInfer's JIT modules (``flashinfer_jit``) and the rows view of a tensor (``rows``)."""
