"""The mlx-lm runtime: the A2ATS cache (CACHE-*), its codebooks, the attention hook, and the decode paths."""
