"""bench/run_all.py: benchmarks run in processes of their own, rendered between the markers of a
markdown file with a chart each; the ThunderFX peer is a stated skip where thunder does not import."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import run_all
from bench.common import Skipped, inductor_option, or_skipped, thunder_compile

ROOT = Path(__file__).resolve().parents[1]
STUB = '''
import argparse, json, os
from pathlib import Path
parser = argparse.ArgumentParser()
parser.add_argument("--size", default="full")
parser.add_argument("--fail", action="store_true")
parser.add_argument("--out", type=Path)
args = parser.parse_args()
if args.fail:
    raise SystemExit(3)
rows = [{"case": "a", "fast ms": 1.5, "slow ms": 2.0, "size": args.size, "pid": os.getpid()}]
(args.out / "stub.json").write_text(json.dumps({"benchmark": "stub", "environment": {"torch": "t"}, "rows": rows}))
'''
CHART = run_all.Chart(("case",), ("fast ms", "slow ms"), "ms")


def unpadded(text: str) -> str:
    """`text` with each run of spaces made one: a markdown table's rows as they read, whatever its padding."""
    return re.sub(" +", " ", text)


def _thunder_imports() -> bool:
    try:
        import thunder.dynamo  # noqa: F401
    except Exception:  # ImportError, or AttributeError on torch >= 2.13
        return False
    return True


no_thunder = pytest.mark.skipif(_thunder_imports(), reason="lightning-thunder imports here")


def _matplotlib_imports() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _stub(tmp_path: Path, name: str, *arguments: str, gpus: int = 0) -> run_all.Benchmark:
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    return run_all.Benchmark(name, f"The {name} benchmark", ((str(script), *arguments),), (),
                             ("--size", "quick"), CHART, gpus=gpus)


def _doc(tmp_path: Path) -> Path:
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(f"# Benchmarks\n\nA reading by hand.\n\n{run_all.BEGIN}\nNot run yet.\n{run_all.END}\n\nAfter.\n")
    return doc


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


QUANTIZE_RESULT = {
    "benchmark": "quantize_ffn", "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0", "python": "3.12.3"},
    "rows": [
        {"model": "ffn", "recipe": "bf16", "mode": "train", "variant": "bf16 inductor", "ms": 12.8},
        {"model": "ffn", "recipe": "bf16", "mode": "train", "variant": "bf16 thunder",
         "skipped": "lightning-thunder does not import here (AttributeError: named tensors)"},
        {"model": "ffn", "recipe": "float8-tensorwise", "mode": "train", "variant": "xform", "ms": 9.0},
    ],
    "refused": {"nvfp4": "needs SM100"},
}


def test_render_replaces_only_the_marked_section_with_tables_and_a_chart(tmp_path):
    doc, out = _doc(tmp_path), tmp_path / "results"
    _write(out / "quantize_ffn.json", QUANTIZE_RESULT)
    bench = next(b for b in run_all.BENCHMARKS if b.name == "quantize_ffn")
    run_all.render([bench], out, doc, doc.parent / "charts")
    text = unpadded(doc.read_text())
    assert text.startswith("# Benchmarks\n\nA reading by hand.\n\n" + run_all.BEGIN)
    assert text.endswith(run_all.END + "\n\nAfter.\n") and "Not run yet." not in text
    assert text.count(run_all.BEGIN) == 1 and text.count(run_all.END) == 1
    assert "### Quantize: SwiGLU FFN" in text and "Measured on NVIDIA H200, torch 2.11.0, Python 3.12.3." in text
    assert "| model | recipe | mode | variant | ms | skipped |" in text
    assert "| ffn | bf16 | train | bf16 thunder | | lightning-thunder does not import here" in text
    assert '- refused: {"nvfp4": "needs SM100"}' in text
    if _matplotlib_imports():
        assert "![quantize_ffn](charts/quantize_ffn.png)" in text
        assert (doc.parent / "charts" / "quantize_ffn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "Chart skipped: matplotlib does not import here" in text


def test_without_matplotlib_the_tables_are_written_and_the_chart_skip_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    doc, out = _doc(tmp_path), tmp_path / "results"
    _write(out / "quantize_ffn.json", QUANTIZE_RESULT)
    bench = next(b for b in run_all.BENCHMARKS if b.name == "quantize_ffn")
    run_all.render([bench], out, doc, doc.parent / "charts")
    text = unpadded(doc.read_text())
    assert "| ffn | bf16 | train | bf16 inductor | 12.8 |" in text
    assert 'Chart skipped: matplotlib does not import here' in text and 'pip install -e ".[bench]"' in text
    assert not (doc.parent / "charts").exists()


def test_markers_are_added_at_the_end_where_missing():
    text = run_all.replace_generated("# Benchmarks\n\nprose\n", "new")
    assert text == f"# Benchmarks\n\nprose\n\n{run_all.BEGIN}\nnew\n{run_all.END}\n"
    assert run_all.replace_generated(text, "newer").count("newer") == 1


def test_chart_points_drop_skips_errors_and_other_tables_rows():
    cudagraphs = next(b for b in run_all.BENCHMARKS if b.name == "cudagraphs_decode_plain")
    summary = [{"case": "decode:plain:1", "inductor ms": 3.7, "xform ms": 0.99, "thunder ms": "skipped: no thunder"},
               {"case": "memory:train", "inductor GiB": 6.5}]
    assert run_all.points(summary, cudagraphs.chart) == [("decode:plain:1", "inductor ms", 3.7),
                                                        ("decode:plain:1", "xform ms", 0.99)]
    assert run_all.points(QUANTIZE_RESULT["rows"], run_all.QUANTIZE_CHART) == [
        ("train bf16", "bf16 inductor", 12.8), ("train float8-tensorwise", "xform", 9.0)]


def test_cudagraphs_runs_are_split_to_fit_a_device_call_and_find_only_their_own_results(tmp_path):
    """bench/cudagraphs.py as one process ran past a device call's 10 minutes on the H200 (decode
    alone: 8 of its 20 configurations in 270 s), so decode as written, decode with syncs and memory
    are benchmarks of their own, each reading the JSON its `--only` names."""
    names = ("cudagraphs_decode_plain", "cudagraphs_decode_sync", "cudagraphs_memory")
    benches = {b.name: b for b in run_all.BENCHMARKS if b.name.startswith("cudagraphs")}
    assert tuple(benches) == names
    for name, only in zip(names, ("decode:plain", "decode:sync", "memory")):
        assert benches[name].runs[0][1:3] == ("--only", only)
        _write(tmp_path / f"cudagraphs_{only.replace(':', '_')}.json", {"environment": {}, "summary": [{"case": only}]})
    assert [list(run_all.load_results(tmp_path, benches[n])) for n in names] == [
        ["cudagraphs_decode_plain"], ["cudagraphs_decode_sync"], ["cudagraphs_memory"]]


def test_cells_are_one_line_without_pipes_and_bounded():
    assert run_all.cell("a|b\nc") == "a\\|b c"
    assert run_all.cell({"k": [1, 2]}) == '{"k": [1, 2]}'
    assert run_all.cell(None) == "" and len(run_all.cell("x" * 1000)) == run_all.CELL_CHARS


def test_each_benchmark_runs_in_a_process_of_its_own_and_is_rendered(tmp_path):
    benchmarks = [_stub(tmp_path, "stub"), _stub(tmp_path, "stub_fails", "--fail"),
                  _stub(tmp_path, "stub_gpu", gpus=1), _stub(tmp_path, "stub_left_out")]
    doc, out = _doc(tmp_path), tmp_path / "results"
    run_all.main(["--out", str(out), "--quick", "--skip", "stub_left_out", "--docs", str(doc)], benchmarks)
    result = json.loads((out / "stub.json").read_text())
    assert result["rows"][0]["size"] == "quick" and result["rows"][0]["pid"] != os.getpid()
    records = {p.stem: json.loads(p.read_text()) for p in (out / "run_all").glob("*.json")}
    assert set(records) == {"stub", "stub_fails", "stub_gpu"}
    assert records["stub"]["status"] == "ran" and records["stub"]["commands"][0].startswith("python ")
    assert records["stub_fails"]["status"] == "failed"
    assert records["stub_fails"]["reason"] == f"{tmp_path}/stub.py --fail: exit status 3"
    if run_all.cuda_devices() == 0:
        assert records["stub_gpu"]["reason"] == "needs 1 CUDA GPU(s), this machine has 0"
    assert records["stub_gpu"]["status"] == ("skipped" if run_all.cuda_devices() == 0 else "ran")
    assert "$ " in (out / "logs" / "stub.log").read_text()
    text = unpadded(doc.read_text())
    assert "### The stub benchmark" in text and "| a | 1.5 | 2.0 | quick |" in text
    assert "Status: failed (" in text and "### The stub_left_out benchmark" not in text


def test_a_process_past_the_timeout_is_ended_and_said_so(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(60)\n")
    log = tmp_path / "log"
    assert run_all.run_process([sys.executable, str(script)], log, timeout=1) == "timed out after 1 s"


def test_only_and_skip_name_known_benchmarks():
    assert [b.name for b in run_all.selected(run_all.BENCHMARKS, "attention,cudagraphs_memory", "cudagraphs_memory")] == ["attention"]
    with pytest.raises(SystemExit, match="unknown benchmark"):
        run_all.selected(run_all.BENCHMARKS, "atention", None)


def test_distribute_launches_with_torchrun_over_every_gpu(tmp_path):
    bench = next(b for b in run_all.BENCHMARKS if b.name == "distribute")
    argv = run_all.command(bench, bench.runs[1], False, tmp_path, gpus=8)
    assert argv[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "8"]
    assert argv[-4:] == ["--strategy", "fsdp", "--out", str(tmp_path)]


@no_thunder
def test_the_thunder_peer_is_a_stated_skip_where_thunder_does_not_import():
    with pytest.raises(Skipped, match="lightning-thunder does not import here"):
        thunder_compile()
    skipped = or_skipped(lambda: thunder_compile(cudagraphs=True)(torch.nn.Linear(2, 2)))
    assert isinstance(skipped, Skipped) and skipped.cell().startswith("skipped: lightning-thunder does not import")


@no_thunder
@pytest.mark.parametrize("code", [
    "import quantize; print(json.dumps(quantize.measure('ffn', [('bf16 thunder', None)], True, 1)))",
    "import cudagraphs; print(json.dumps([cudagraphs.run_one('decode:sync:8:thunder-cudagraphs')]))",
])
def test_the_benchmarks_record_the_thunder_skip_and_go_on(code):
    """In a process of its own (the benchmark scripts put bench/ first on sys.path), on a CPU: the
    skip comes before any model is built on the GPU."""
    done = subprocess.run([sys.executable, "-c", f"import json, sys; sys.path.insert(0, 'bench'); {code}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout.splitlines()[-1])
    assert row["skipped"].startswith("lightning-thunder does not import here")


@pytest.mark.thunder
@pytest.mark.skipif(not _thunder_imports(), reason="lightning-thunder does not import here (it needs torch 2.11)")
def test_the_thunder_peer_compiles_with_thunderfx_where_thunder_imports():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(2, 8)
    torch.testing.assert_close(thunder_compile()(model)(x), model(x))


def test_bench_scripts_read_inductor_options_as_json_else_as_strings():
    assert inductor_option("triton.tile_reductions=true") == ("triton.tile_reductions", True)
    assert inductor_option("max_autotune_gemm_backends=TRITON") == ("max_autotune_gemm_backends", "TRITON")
    with pytest.raises(SystemExit, match="--inductor-option takes KEY=VALUE, not 'tile_reductions'"):
        inductor_option("tile_reductions")


def test_decode_figures_are_the_median_over_processes_with_their_range():
    # a decode process on the H200 is fast or slow as a whole, so a configuration runs in several
    from bench import cudagraphs

    ms = {"xform": [0.99, 1.06, 1.0], "reduce-overhead": [1.05, 0.975, 1.05]}
    rows = [{"spec": f"decode:plain:1:{config}", "ms_per_step": t} for i in range(3) for config, t in
            ((c, ms[c][i]) for c in ms)]
    rows.append({"spec": "decode:plain:1:thunder", "skipped": "no thunder"})
    (summary,) = cudagraphs.summarize(rows)
    assert summary["xform ms"] == 1.0 and summary["reduce-overhead ms"] == 1.05
    assert summary["xform/reduce-overhead"] == 0.952
    assert summary["xform range"] == "0.99-1.06 (3)" and summary["reduce-overhead range"] == "0.975-1.05 (3)"
    assert summary["thunder ms"] == "skipped: no thunder" and "inductor range" not in summary
    assert summary["xform-error/reduce-overhead"] is None  # not run


def test_a_full_configuration_name_selects_it_alone():
    from bench import cudagraphs

    assert cudagraphs.selected(["decode:plain:1:xform"]) == ["decode:plain:1:xform"]
    assert cudagraphs.selected(["decode:plain:1:xform-error", "memory:train:xform"]) == [
        "decode:plain:1:xform-error", "memory:train:xform"]
    assert cudagraphs.selected(["plain:8:xform"]) == ["decode:plain:8:xform", "decode:plain:8:xform-error"]


def test_decode_processes_are_timed_after_one_untimed_process_per_configuration_fills_the_caches(monkeypatch):
    # on the H100 a process that compiled its kernels itself stepped ~6% faster than one that loaded
    # them from the caches, whatever the configuration: no timed process may be the cold one
    from bench import cudagraphs

    started = []
    monkeypatch.setattr(cudagraphs, "run_in_process",
                        lambda script, spec, env=None: started.append((spec, env or {})) or {"spec": spec})
    specs = ["decode:plain:1:xform", "decode:plain:1:reduce-overhead"]
    rows = cudagraphs.run_all(specs, jobs=1, save=lambda rows: None, processes=2)
    prime = {cudagraphs.PRIME_ENV: "1"}
    assert started == [(specs[0], prime), (specs[1], prime)] + [(s, {}) for s in specs * 2]
    assert [r["spec"] for r in rows] == specs * 2


def test_kernel_split_sums_kinds_per_step_and_lists_the_costliest_kernels():
    from bench import kernel_split

    launches = [("nvjet_tst_128x256", 3000.0), ("triton_red_fused_amax_0", 800.0), ("triton_red_fused_amax_0", 700.0),
                ("triton_poi_fused_mul_1", 100.0), ("Memset (Device)", 20.0)]  # us, over 2 steps
    result = kernel_split.summarize(launches, steps=2, top=2)
    assert result["gemm ms"] == 1.5 and result["triton ms"] == 0.8 and result["other ms"] == 0.01
    assert result["top"] == [{"kernel": "nvjet_tst_128x256", "ms": 1.5, "calls": 0.5},
                             {"kernel": "triton_red_fused_amax_0", "ms": 0.75, "calls": 1.0}]
    assert "top" not in kernel_split.summarize(launches, steps=2)


def test_kernel_timeline_gives_span_idle_time_and_the_median_gap_per_step():
    # decode processes with the same kernels took 1.14 or 1.21 ms a step on the H100: the gaps differ
    from bench import kernel_split

    # us over 2 steps: kernels 0-10 and 5-12 overlap; then gaps of 3, 1 and 8 us
    intervals = [(15.0, 20.0), (0.0, 10.0), (5.0, 12.0), (21.0, 30.0), (38.0, 40.0)]
    assert kernel_split.timeline(intervals, steps=2) == {"span ms": 0.02, "idle ms": 0.006, "median gap us": 2.0}


def test_a_benchmark_not_run_again_keeps_its_last_section_with_its_date(tmp_path):
    """Device calls each run some benchmarks: rendering one call's results replaces their sections and
    keeps the others' from the runs that measured them, each saying when that was."""
    doc = _doc(tmp_path)
    quantize, attention = (next(b for b in run_all.BENCHMARKS if b.name == n) for n in ("quantize_ffn", "attention"))
    first, second = tmp_path / "first", tmp_path / "second"
    _write(first / "quantize_ffn.json", QUANTIZE_RESULT)
    run_all.render(run_all.BENCHMARKS, first, doc, doc.parent / "charts", chosen=[quantize])
    earlier = run_all.earlier_sections(doc.read_text())
    assert list(earlier) == [quantize.title] and f"{run_all.RAN_ON} " in earlier[quantize.title]
    _write(second / "attention.json", {"environment": {}, "rows": [{"seq": 1024, "xform": 0.5}]})
    run_all.render(run_all.BENCHMARKS, second, doc, doc.parent / "charts", chosen=[attention])
    now = run_all.earlier_sections(doc.read_text())
    assert list(now) == [quantize.title, attention.title]
    assert now[quantize.title] == earlier[quantize.title] and f"results in `{first}`" in now[quantize.title]
    assert f"results in `{second}`" in now[attention.title] and "| 1024 | 0.5 |" in unpadded(now[attention.title])


def test_sections_of_the_older_format_are_kept_with_the_block_date():
    block = (f"{run_all.BEGIN}\nGenerated 2026-12-03 16:21 UTC by `python bench/run_all.py` from the results in "
             f"`/tmp/allres`.\n\n### CUDA graphs: memory\n\nStatus: ran.\n\n| a |\n\n### Other\n\nNo results.\n{run_all.END}")
    sections = run_all.earlier_sections(f"# B\n\n{block}\n")
    assert sections["CUDA graphs: memory"] == ("### CUDA graphs: memory\n\nRun on 2026-12-03 16:21 UTC, results in "
                                               "`/tmp/allres`.\nStatus: ran.\n\n| a |\n")
    assert list(sections) == ["CUDA graphs: memory", "Other"]


def test_a_section_is_dated_by_when_its_results_were_measured_not_rendered(tmp_path):
    doc, out = _doc(tmp_path), tmp_path / "results"
    quantize, attention = (next(b for b in run_all.BENCHMARKS if b.name == n) for n in ("quantize_ffn", "attention"))
    _write(out / "quantize_ffn.json", QUANTIZE_RESULT)  # no record: dated by its file
    when = 1764778860  # 2025-12-03 16:21 UTC
    os.utime(out / "quantize_ffn.json", (when, when))
    _write(out / "attention.json", {"environment": {}, "rows": [{"seq": 1024}]})
    _write(out / "run_all" / "attention.json", {"status": "ran", "commands": [], "finished": "2026-12-05 07:40 UTC"})
    run_all.render([quantize, attention], out, doc, doc.parent / "charts")
    sections = run_all.earlier_sections(doc.read_text())
    assert f"{run_all.RAN_ON} 2025-12-03 16:21 UTC, results in `{out}`." in sections[quantize.title]
    assert f"{run_all.RAN_ON} 2026-12-05 07:40 UTC, results in `{out}`." in sections[attention.title]
