"""M2R2 itself: accelerator adapters, the fast stream over the shared KV cache, ARLA, adapter files."""
