"""Expected Attention (DESIGN.md §4.9): keep the keys that future queries are expected to attend to.

A. Devoto, M. Jeblick, S. Jégou, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv:2510.00636 (2025); kvpress's ExpectedAttentionPress.

Question-agnostic: it does not score with the window queries themselves but with a Gaussian fitted to them,
q ~ N(mu, Sigma) per query head, moved to future positions by the mean RoPE rotation R over the next
positions (`future_rotation`, D x D; None: the window's own positions). For such a q,
E[exp(s q.k)] = exp(s mu'.k + s^2/2 k^T Sigma' k), mu' = R mu, Sigma' = R Sigma R^T, so per query head

    S_j = softmax_j(s mu'.k_j + s^2/2 k_j^T Sigma' k_j) * ||v_j||,

combined over a KV head's query heads by `gqa` (mean: the paper's). Sigma is the biased covariance of the w
window rows, so k^T Sigma' k = mean_i ((R (q_i - mu)) . k)^2: O(w D) a key, never a D x D product per key.
Defaults: w = 32 window rows (protected, as every query-based policy's), 4 sink tokens (the paper's), no pooling.
"""

from __future__ import annotations

import torch

from .base import HEAD_CHUNK, Policy
from .ragged import map_heads


FUTURE_POSITIONS = 512  # the offsets after a window query whose mean rotation the engine passes (the paper's)


class ExpectedAttention(Policy):
    name = "expected-attention"
    needs_queries = True
    default_window = 32
    default_sink = 4

    def base_scores(self, q_window, keys, values, *, pool_kernel: int, gqa: str, scale: float,
                    lengths: torch.Tensor | None = None, future_rotation: torch.Tensor | None = None,
                    **_: object) -> torch.Tensor:
        n, num_kv, dim = keys.shape
        w, num_q, _ = q_window.shape
        g = num_q // num_kv
        q = q_window.to(torch.float32).reshape(w, num_kv, g, dim).permute(1, 2, 0, 3).contiguous()  # [H, g, w, D]
        mean = q.mean(dim=2, keepdim=True)
        centered = q - mean
        if future_rotation is not None:
            rotation = future_rotation.to(device=q.device, dtype=torch.float32)
            mean, centered = mean @ rotation.T, centered @ rotation.T
        def heads_scores(heads: slice, m: int) -> torch.Tensor:
            k = keys[:m, heads].to(torch.float32).permute(1, 2, 0).unsqueeze(1)      # [h, 1, D, m]
            first = (mean[heads] @ k).squeeze(2)                                     # [h, g, m]
            second = (centered[heads] @ k).square().mean(dim=2)                      # [h, g, m]
            probs = torch.softmax(scale * first + 0.5 * scale * scale * second, dim=-1)
            probs = probs.mean(dim=1) if gqa == "mean" else probs.amax(dim=1)
            return probs * torch.linalg.vector_norm(values[:m, heads].to(torch.float32), dim=-1).T

        return map_heads(heads_scores, num_kv, n, lengths, HEAD_CHUNK)


def mean_rotation(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, neox: bool) -> torch.Tensor:
    """R [head_dim, head_dim] float32: the mean over offsets of the RoPE rotations with cos, sin [offsets,
    rotary_dim / 2] (neox: dimension j pairs with j + rotary_dim / 2, else 2j with 2j + 1; dimensions past
    rotary_dim are not rotated), so that R q is the mean of a post-RoPE query moved by each offset."""
    half = cos.shape[-1]
    c, s = cos.to(torch.float64).mean(dim=0), sin.to(torch.float64).mean(dim=0)
    rotation = torch.eye(head_dim, dtype=torch.float64, device=c.device)
    j = torch.arange(half, device=c.device)
    first, second = (j, j + half) if neox else (2 * j, 2 * j + 1)
    rotation[first, first], rotation[second, second] = c, c
    rotation[first, second], rotation[second, first] = -s, s
    return rotation.to(torch.float32)
