"""OBCache (DESIGN.md §4.4): second-order (OBD) saliency of zeroing v_j, k_j or both, summed over window rows.

With A = p, Z = z (0 at masked positions), o = a:
  value:  A^2 ||v||^2
  key:    A^2 Z^2 ||v - o||^2
  joint:  A^2 ||(1+Z) v - Z o||^2 = A^2 [(1+Z)^2 ||v||^2 - 2 Z (1+Z) <o,v> + Z^2 ||o||^2]
w = 32, max-pool 7, window protected. ||v - o||^2 uses the clamped kernel identity; the expanded joint
term is a squared norm, so it is clamped to >= 0 per (row, token) as well (rounding only).
"""

import torch

from .base import WindowPolicy


class OBCacheValue(WindowPolicy):
    name = "obcache-value"
    has_kernel = True  # kernels/window_scores.py
    default_window = 32
    default_pool_kernel = 7

    def head_raw(self, st):
        return (st.p * st.p).sum(dim=1) * st.vv


class OBCacheKey(WindowPolicy):
    name = "obcache-key"
    has_kernel = True  # kernels/window_scores.py
    default_window = 32
    default_pool_kernel = 7

    def head_raw(self, st):
        pz = st.p * st.z
        return (pz * pz * st.d2).sum(dim=1)


class OBCacheJoint(WindowPolicy):
    name = "obcache-joint"
    has_kernel = True  # kernels/window_scores.py
    default_window = 32
    default_pool_kernel = 7

    def head_raw(self, st):
        z = st.z
        sq = (1.0 + z) ** 2 * st.vv - 2.0 * z * (1.0 + z) * st.av + z * z * st.aa
        return (st.p * st.p * torch.clamp(sq, min=0.0)).sum(dim=1)
