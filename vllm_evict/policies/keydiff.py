"""KeyDiff (DESIGN.md §4.3): keep the keys least similar to the mean raw key (post-RoPE, unnormalised).

S_j = -<mu, k_j> / max(||mu|| ||k_j||, 1e-8), mu = mean of the head's n keys. No queries, no GQA step,
nothing protected unless `window` / `sink` is requested. (chunked=true is an engine mode; it re-scores
the current cache with this same function.)
"""

import torch

from .base import KeyPolicy

EPS_COS = 1e-8


class KeyDiff(KeyPolicy):
    name = "keydiff"
    has_kernel = True  # kernels/key_scores.py

    def key_score(self, k: torch.Tensor) -> torch.Tensor:
        mu = k.mean(dim=1, keepdim=True)                                        # [heads, 1, D]
        denom = torch.clamp(torch.linalg.vector_norm(mu, dim=-1) * torch.linalg.vector_norm(k, dim=-1), min=EPS_COS)
        return -torch.matmul(k, mu.transpose(1, 2)).squeeze(-1) / denom
