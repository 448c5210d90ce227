"""What was allocated when a run's reserved GPU memory peaked: by stream and by place in the code.

`with PeakTracer() as tracer: ...` records the caching allocator's history over the block
(`torch.cuda.memory._record_memory_history`), then replays its events to the moment the reserved
total was highest and reports, in `tracer.at_peak`: the reserved and allocated bytes by the stream
that made each segment or block (a graph pool's memory is made on its recording stream, the
ordinary code's on the default stream, 0), the largest live blocks, and the live bytes by the first
frame outside torch (the line of xform, the bench or the model that asked). Memory reserved before
the block (the model's weights) counts in the totals, with no place. A block counts as allocated
until the allocator completes its free (`free_completed`), as the memory history shows it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

GIB = 2**30
# trace actions that change the reserved total (segments mapped and unmapped: expandable segments)
_GROWS = {"segment_alloc", "segment_map"}
_SHRINKS = {"segment_free", "segment_unmap"}


def _short(frame: dict[str, Any]) -> str:
    return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"


def _place(frames: list[dict[str, Any]]) -> str:
    """Where a block was asked for: the innermost frame outside torch's own files (generated
    Inductor code, the model), then the innermost of xform's or the bench's, when it is another."""
    outside = [f for f in frames if "/torch/" not in f["filename"]]
    if not outside:
        return _short(frames[0]) if frames else "(no Python frames)"
    ours = next((f for f in outside if "/xform/" in f["filename"] or "/bench/" in f["filename"]), None)
    return _short(outside[0]) + (f" < {_short(ours)}" if ours is not None and ours is not outside[0] else "")


class PeakTracer:
    """Records the allocator's history over a `with` block; `at_peak` after it."""

    def __init__(self, max_entries: int = 2_000_000) -> None:
        self.max_entries = max_entries
        self.at_peak: dict[str, Any] = {}
        self._start: list[dict[str, Any]] = []  # the allocator's segments when the block began

    def __enter__(self) -> PeakTracer:
        torch.cuda.synchronize()
        device = torch.cuda.current_device()
        self._start = [s for s in torch.cuda.memory._snapshot()["segments"] if s.get("device", device) == device]
        torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=self.max_entries)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize()
        try:
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        finally:
            torch.cuda.memory._record_memory_history(None)
        if exc[0] is not None:
            return
        if len(trace) >= self.max_entries:  # a ring buffer: the oldest events were dropped
            self.at_peak = {"error": f"the history outgrew max_entries={self.max_entries}: raise it"}
            return
        self.at_peak = self._replay(trace)

    def _replay(self, trace: list[dict[str, Any]]) -> dict[str, Any]:
        segments = {s["address"]: (s["total_size"], s.get("stream", 0)) for s in self._start}
        blocks: dict[int, tuple[int, int, str]] = {}
        for s in self._start:
            address = s["address"]
            for b in s["blocks"]:
                if b["state"] == "active_allocated":
                    blocks[b.get("address", address)] = (b["size"], s.get("stream", 0), "(before the trace)")
                address = b.get("address", address) + b["size"]
        reserved = sum(size for size, _ in segments.values())
        peak, peak_at = reserved, -1
        for i, e in enumerate(trace):  # first pass: when the reserved total peaked
            if e["action"] in _GROWS:
                reserved += e["size"]
            elif e["action"] in _SHRINKS:
                reserved -= e["size"]
            if reserved > peak:
                peak, peak_at = reserved, i
        # second pass: the segments and blocks alive at the peak; while the reserved total stays
        # there, the moment the most of it was allocated (the block a new segment was made for)
        allocated = sum(b[0] for b in blocks.values())
        live, at = dict(blocks), allocated
        for i, e in enumerate(trace):
            action, addr = e["action"], e.get("addr")  # an "oom" entry has no address
            if i > peak_at and (action in _GROWS or action in _SHRINKS):
                break
            if action in _GROWS:
                segments[addr] = (e["size"], e.get("stream", 0))
            elif action in _SHRINKS:
                segments.pop(addr, None)
            elif action == "alloc":
                blocks[addr] = (e["size"], e.get("stream", 0), _place(e.get("frames", [])))
                allocated += e["size"]
            elif action == "free_completed" and addr in blocks:
                allocated -= blocks.pop(addr)[0]
            if i >= peak_at and (i == peak_at or allocated > at):
                live, at = dict(blocks), allocated
        blocks = live
        by_stream: dict[str, dict[str, float]] = {}

        def count(stream: int, kind: str, size: int) -> None:
            by_stream.setdefault(str(stream), {"reserved": 0.0, "allocated": 0.0})[kind] += size / GIB

        for size, stream in segments.values():
            count(stream, "reserved", size)
        places: Counter[str] = Counter()
        for size, stream, place in blocks.values():
            count(stream, "allocated", size)
            places[place] += size
        largest = sorted(blocks.values(), reverse=True)[:12]
        return {"reserved_gib": round(peak / GIB, 3), "event": peak_at, "events": len(trace),
                "allocated_gib": round(at / GIB, 3),
                "by_stream": {k: {n: round(v, 3) for n, v in d.items()} for k, d in by_stream.items()},
                "largest_mib": [[round(size / 2**20, 1), str(stream), place] for size, stream, place in largest],
                "by_place_mib": [[place, round(size / 2**20, 1)] for place, size in places.most_common(15)]}
