"""Scoring + compaction time per request, as reported (`latency_ms`), without a device sync."""

from __future__ import annotations

import time

import torch


class CompactionTimer:
    """Scoring + compaction time per request: CUDA events around each layer's work (device time, read
    once the events completed, so never a sync), or host time on CPU where the work is synchronous."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {}

    def start(self, device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, req_ids: list[str], started) -> None:
        """End the span of a batch of requests compacted together: each is charged an equal share."""
        share = 1 / len(req_ids)
        if isinstance(started, float):
            span = (time.perf_counter() - started) * 1e3 * share
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            span = (started, end, share)
        for req_id in req_ids:
            self.pending.setdefault(req_id, []).append(span)

    def collect(self) -> dict[str, float]:
        """Milliseconds per request whose events all completed; the others stay pending."""
        done: dict[str, float] = {}
        for req_id, spans in list(self.pending.items()):
            if all(isinstance(s, float) or s[1].query() for s in spans):
                done[req_id] = sum(s if isinstance(s, float) else s[0].elapsed_time(s[1]) * s[2] for s in spans)
                del self.pending[req_id]
        return done
