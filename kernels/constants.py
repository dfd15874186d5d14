"""Small int64 tensors that kernel launches read (layer offsets, layer indices), made once per device and
kept for the process: a CUDA graph that captured a launch reads the same tensor at every replay (so none is
ever dropped, and none is made during a capture, which would record the copy into it without running it)."""

from __future__ import annotations

import torch

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def device_ints(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 `values` on `device`, the same tensor on every call."""
    key = (values, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"index tensor {values} was not made before the CUDA graph capture")
        tensor = _CONSTANTS[key] = torch.tensor(values, dtype=torch.int64).to(device)
    return tensor
