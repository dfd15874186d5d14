"""Quality benchmarks: RULER-style synthetic tasks (`ruler`) and the eviction evaluation runner (`eval`)."""
