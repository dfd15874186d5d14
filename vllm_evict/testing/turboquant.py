"""Random TurboQuant slots for the kernel tests and benchmarks (kernels/turboquant_slots.py has the format)."""

from __future__ import annotations

import torch


def random_slots(config, shape: tuple, gen: torch.Generator, e4b15: bool) -> torch.Tensor:
    """Slots [*shape, S] uint8 that decode to finite keys and values."""
    slots = torch.randint(0, 256, (*shape, config.slot_size_aligned), generator=gen, dtype=torch.uint8)

    def put_fp16(at: int, values: torch.Tensor) -> None:
        slots[..., at: at + 2] = values.to(torch.float16).view(torch.uint8).view(*shape, 2)

    if config.key_fp8:
        if not e4b15:  # e4m3 has NaN at 0x7f / 0xff, which no store writes
            key = slots[..., : config.head_dim]
            key[(key & 0x7F) == 0x7F] = 0
    else:
        put_fp16(config.key_packed_size - 2, torch.rand(shape, generator=gen) * 20)
    scale_at = config.key_packed_size + config.value_packed_size - 4
    put_fp16(scale_at, torch.randn(shape, generator=gen) * 0.3)
    put_fp16(scale_at + 2, torch.randn(shape, generator=gen))
    return slots
