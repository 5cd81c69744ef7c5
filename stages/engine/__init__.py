"""The engine core: scheduler, paged KV cache, model runner and sampler. No Ray imports here."""
