"""K-norm (DESIGN.md §4.7): keep low-norm keys, S_j = -||k_j||_2 per KV head."""

import torch

from .base import KeyPolicy


class KNorm(KeyPolicy):
    name = "knorm"
    has_kernel = True  # kernels/key_scores.py

    def key_score(self, k: torch.Tensor) -> torch.Tensor:
        return -torch.linalg.vector_norm(k, dim=-1)
