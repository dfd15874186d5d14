"""TOVA (DESIGN.md §4.7): attention of the last prompt query; no pooling; the last token is protected.

With a larger window (w > 1) the raw score is still the last row's attention, and all w window
positions are protected.
"""

from .base import WindowPolicy


class TOVA(WindowPolicy):
    name = "tova"
    has_kernel = True  # kernels/window_scores.py
    default_window = 1
    default_pool_kernel = 1

    def head_raw(self, st):
        # raw^h_j = p_j^{h, w-1} (the last prompt position)
        return st.p[:, -1, :]
