"""H2O, SnapKV-style (DESIGN.md §4.7): attention summed over the window rows, no pooling, window protected.

The original H2O sums over all n prompt queries: pass all n queries (w = n), which is quadratic.
"""

from .base import WindowPolicy


class H2O(WindowPolicy):
    name = "h2o"
    has_kernel = True  # kernels/window_scores.py
    default_window = 32
    default_pool_kernel = 1

    def head_raw(self, st):
        # raw^h_j = sum_t p_j^{h,t}
        return st.p.sum(dim=1)
