"""Model building blocks: TP-aware linear and embedding layers, RoPE, RMSNorm, paged
attention and the batched sampler."""
