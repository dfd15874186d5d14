"""SnapKV (DESIGN.md §4.1): mean window attention, GQA mean, max-pool 7, window protected (Ada-KV settings)."""

from .base import WindowPolicy


class SnapKV(WindowPolicy):
    name = "snapkv"
    has_kernel = True  # kernels/window_scores.py
    default_window = 32
    default_pool_kernel = 7

    def head_raw(self, st):
        # raw^h_j = (1/w) sum_t p_j^{h,t}
        return st.p.mean(dim=1)
