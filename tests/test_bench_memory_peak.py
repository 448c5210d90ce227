"""bench/memory_peak.py's replay of an allocator history, on a made-up trace (no GPU needed)."""

from bench.memory_peak import GIB, PeakTracer


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_the_state_at_the_peak_is_the_one_reported_not_the_end():
    tracer = PeakTracer()
    tracer._start = [{"address": 0, "total_size": GIB, "stream": 0,
                      "blocks": [{"size": GIB // 2, "state": "active_allocated"},
                                 {"size": GIB // 2, "state": "inactive"}]}]
    graph = [_frame("/x/torch/cuda/graphs.py", 1, "capture"), _frame("/tmp/inductor/ab.py", 40, "call"),
             _frame("/repo/xform/transforms/cudagraphs/replay.py", 200, "record")]
    trace = [
        {"action": "segment_alloc", "addr": 2 * GIB, "size": GIB, "stream": 7},
        {"action": "alloc", "addr": 2 * GIB, "size": GIB // 4, "stream": 7, "frames": graph},
        {"action": "segment_alloc", "addr": 4 * GIB, "size": 2 * GIB, "stream": 0},
        {"action": "alloc", "addr": 4 * GIB, "size": GIB, "stream": 0,
         "frames": [_frame("/repo/bench/cudagraphs.py", 9, "run")]},
        {"action": "free_completed", "addr": 4 * GIB, "size": GIB, "stream": 0},
        {"action": "segment_free", "addr": 4 * GIB, "size": 2 * GIB, "stream": 0},
    ]
    at = tracer._replay(trace)
    assert (at["reserved_gib"], at["allocated_gib"], at["event"]) == (4.0, 1.75, 2)
    assert at["by_stream"] == {"0": {"reserved": 3.0, "allocated": 1.5}, "7": {"reserved": 1.0, "allocated": 0.25}}
    assert at["largest_mib"][0] == [1024.0, "0", "cudagraphs.py:9 run"]
    assert ["ab.py:40 call < replay.py:200 record", 256.0] in at["by_place_mib"]


def test_a_run_that_never_grows_reports_its_start_and_an_oom_entry_is_read():
    tracer = PeakTracer()
    tracer._start = [{"address": 0, "total_size": GIB, "stream": 0,
                      "blocks": [{"size": GIB // 2, "state": "active_allocated"},
                                 {"size": GIB // 2, "state": "inactive"}]}]
    trace = [{"action": "oom", "size": 4 * GIB, "stream": 0},
             {"action": "alloc", "addr": GIB // 2, "size": GIB // 4, "stream": 0, "frames": []},
             {"action": "free_completed", "addr": GIB // 2, "size": GIB // 4, "stream": 0}]
    at = tracer._replay(trace)
    assert (at["reserved_gib"], at["allocated_gib"], at["event"]) == (1.0, 0.75, -1)
    assert at["by_place_mib"] == [["(before the trace)", 512.0], ["(no Python frames)", 256.0]]
