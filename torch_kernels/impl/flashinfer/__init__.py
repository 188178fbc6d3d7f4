"""FlashInfer backend: our ops mapped onto FlashInfer's API, one module per op family."""
