"""Small argument checks shared by the policy modules (all raise ValueError naming the value)."""

from __future__ import annotations

import numbers

import torch


def is_int(x: object) -> bool:
    """A true integer (Python or numpy int), never a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A real number (int or float, Python or numpy), never a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# Integers of a request travel to the engine core in vLLM's msgspec messages, which hold 64-bit integers
# only: a larger one is a bad request (400), not a serialisation failure (500).
INT_MAX = 2**63 - 1


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)  # type: ignore[arg-type]
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if value > INT_MAX:
        raise ValueError(f"{name} must be at most 2**63 - 1, got {value!r}")
    return value


def check_pool_kernel(value: object) -> int:
    k = check_int("pool_kernel", value)
    if k < 1 or k % 2 == 0:
        raise ValueError(f"pool_kernel must be a positive odd integer, got {value!r}")
    return k


def check_gqa(value: object) -> str:
    if value not in ("mean", "max"):
        raise ValueError(f"gqa must be 'mean' or 'max', got {value!r}")
    return value  # type: ignore[return-value]


def check_kv(keys: object, values: object) -> tuple[int, int]:
    """keys [n, H_kv, D], values [n, H_kv, Dv] on one device; returns (n, H_kv)."""
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [n, H_kv, D], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
    if keys.shape[:2] != values.shape[:2]:
        raise ValueError(
            f"keys and values disagree on [n, H_kv]: keys {tuple(keys.shape)} vs values {tuple(values.shape)}"
        )
    if keys.device != values.device:
        raise ValueError(f"keys on {keys.device} but values on {values.device}")
    n, h_kv = int(keys.shape[0]), int(keys.shape[1])
    if n < 1:
        raise ValueError(f"need at least one prompt token, got n={n}")
    if h_kv < 1:
        raise ValueError(f"need at least one KV head, got H_kv={h_kv}")
    return n, h_kv


def check_queries(q_window: object, keys: torch.Tensor) -> tuple[int, int]:
    """q_window [w, H_q, D] matching keys [n, H_kv, D]; returns (w, group size g)."""
    if not isinstance(q_window, torch.Tensor):
        raise ValueError(f"q_window must be a torch.Tensor, got {type(q_window).__name__}")
    if q_window.dim() != 3:
        raise ValueError(f"q_window must have shape [w, H_q, D], got shape {tuple(q_window.shape)}")
    if not q_window.is_floating_point():
        raise ValueError(f"q_window must be a floating-point tensor, got dtype {q_window.dtype}")
    if q_window.device != keys.device:
        raise ValueError(f"q_window on {q_window.device} but keys on {keys.device}")
    w, h_q, d = (int(s) for s in q_window.shape)
    h_kv, d_k = int(keys.shape[1]), int(keys.shape[2])
    if d != d_k:
        raise ValueError(f"head dimension mismatch: q_window has D={d}, keys have D={d_k}")
    if h_q < 1 or h_q % h_kv != 0:
        raise ValueError(f"H_q={h_q} is not a positive multiple of H_kv={h_kv}")
    return w, h_q // h_kv
