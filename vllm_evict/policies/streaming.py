"""StreamingLLM (DESIGN.md §4.6): keep the first `sink` = 4 tokens and the most recent ones (S_j = j).

Allocation is always uniform (Ada-KV is ignored). Pooling and gqa do not apply. Scores are float32, so
recency is exact for n <= 2^24.
"""

import torch

from .base import Policy


class Streaming(Policy):
    name = "streaming"
    default_sink = 4
    supports_adakv = False

    def base_scores(self, q_window, keys, values, **_: object) -> torch.Tensor:
        n, h = keys.shape[0], keys.shape[1]
        return torch.arange(n, dtype=torch.float32, device=keys.device).expand(h, n).clone()
