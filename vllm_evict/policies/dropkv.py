"""DropKV (DESIGN.md §4.2): exact single-eviction output change of the window rows.

Evicting token j changes window output t by p_j/(1-p_j) (a - v_j); the cost is the squared norm summed
over the window rows. It is a retention score as is (large cost = keep). w = 8, max-pool 11.
"""

from .base import WindowPolicy

EPS = 1e-6


class DropKV(WindowPolicy):
    name = "dropkv"
    has_kernel = True  # kernels/window_scores.py
    default_window = 8
    default_pool_kernel = 11

    def head_raw(self, st):
        # raw^h_j = sum_t (p/(1-p+eps))^2 * ||a^{h,t} - v_j||^2   (d^2 by the clamped identity)
        omega = (st.p / (1.0 - st.p + EPS)) ** 2
        return (omega * st.d2).sum(dim=1)
