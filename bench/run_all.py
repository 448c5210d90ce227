"""Run every benchmark, each in a process of its own, and write docs/benchmarks-history.md's generated section.

    python bench/run_all.py --out DIR                      # every benchmark, then render
    python bench/run_all.py --out DIR --only quantize_ffn,attention --quick
    python bench/run_all.py --out DIR --skip distribute
    python bench/run_all.py --out DIR --render-only        # render results already in DIR

Each benchmark script runs in a subprocess of its own (so configurations share no CUDA context or
caching allocator) and writes its JSON into `--out`; its output goes to `DIR/logs/<name>.log` and
what became of it (ran, failed, skipped and why) to `DIR/run_all/<name>.json`. Then the results
are rendered: a markdown section per benchmark (a table of its JSON rows) between the markers
`<!-- run_all: begin -->` and `<!-- run_all: end -->` of docs/benchmarks-history.md (the hand-written
readings outside them are kept), and a bar chart per benchmark in docs/charts/<name>.png.
`--quick` runs fewer configurations, repeats and sizes: a check that everything runs, not figures.

On the device machine: only what is under $OUT comes back, so run there and render here:

    device: python3 bench/run_all.py --out $OUT/results
    here:   python bench/run_all.py --render-only --out <files_at>/results

All of it takes longer than one device call may run (10 minutes): split it over several calls
with --only (--timeout ends a benchmark that would overrun; every script writes its JSON after
each configuration, so what ran before the end is kept) and render each call's results folder in
turn: a benchmark with nothing in the folder rendered keeps the section of the run that measured
it, and each section says when that was.

Measured on the H200 (2026-12-03): quantize_ffn 233 s, attention 167 s (after FlashAttention-4's
two-call install), quantize_block over 170 s, cudagraphs_memory about 200 s,
decode about 34 s a configuration (10 in each decode benchmark), compile_overhead 297 s on the
2-core CPU. On the H100 (2026-12-05): attention 154 s, attention + quantize_ffn 279 s together,
quantize_block 141 s, cudagraphs_memory 133 s, decode with syncs 268 s, decode as written past
285 s (8 of its 10 configurations). So: one call for quantize_ffn + attention, one for
quantize_block + cudagraphs_memory, one per decode benchmark (`--timeout 500`: a decode benchmark
needs about 300 s). FlashAttention-4's CuTeDSL on the path (for attention) makes torchao 0.17's
float8-blockwise and mxfp8 fail to import (`cutlass.base_dsl._mlir_helpers`): run quantize_ffn in
a call without it to measure those. The peers need their wheels carried in (`../shared/device/fetch-wheels.sh
base thunder`: torchao, lightning-thunder); a peer that does not import is recorded as
"skipped: <reason>" and the rest runs.

Charts need matplotlib, the optional extra `bench` (`pip install -e ".[bench]"`); without it the
markdown is written all the same and says why the charts were skipped. To render on the device,
which has no network, download its wheels here into an ignored folder and carry it:

    echo /.mplwhl/ >> .git/info/exclude
    python -m pip download -d .mplwhl --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \\
      matplotlib==3.11.2
    device (carry [".mplwhl"]): python3 -m pip install -q --no-index --no-deps --target /tmp/mpl \\
      .mplwhl/*.whl && export PYTHONPATH=$PWD:/tmp/mpl

(about 39 MB: matplotlib, numpy, pillow, kiwisolver, pyparsing, cycler, fonttools, contourpy,
python-dateutil, packaging, tzdata).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from tabulate import tabulate
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks-history.md"
BEGIN, END = "<!-- run_all: begin -->", "<!-- run_all: end -->"
CELL_CHARS = 160
RAN_ON = "Run on"  # a section's first line: when its results were measured, and where they were


@dataclass(frozen=True)
class Chart:
    """A grouped bar chart: a group of bars per row, named by the `label` columns. Wide rows draw
    each `values` column as a bar named after it; long rows (`series` set) draw the `values`
    column as a bar named by the row's `series` column."""

    label: tuple[str, ...]
    values: tuple[str, ...]
    unit: str
    series: str | None = None


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: the processes that run it (a script and its arguments each, then `full`'s or
    under --quick `quick`'s), the JSON files they write (`<name>*.json` in the results folder), the
    rows to tabulate and how to chart them. `gpus`: the CUDA GPUs it needs (0: runs on a CPU too);
    more than one launches it with torchrun over every GPU there."""

    name: str
    title: str
    runs: tuple[tuple[str, ...], ...]
    full: tuple[str, ...]
    quick: tuple[str, ...]
    chart: Chart
    gpus: int = 1
    table: str = "rows"


QUANTIZE_CHART = Chart(("mode", "recipe"), ("ms",), "ms a step", series="variant")
DECODE_CHART = Chart(("case",), ("inductor ms", "reduce-overhead ms", "xform ms", "xform-error ms", "thunder ms",
                                 "thunder-cudagraphs ms"), "ms a decode step")
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("compile_overhead", "Compile-time overhead of xform with no transforms over Inductor",
              (("bench/compile_overhead.py",),), ("--repeats", "8"), ("--repeats", "2"),
              Chart(("model",), ("inductor_s", "xform_s"), "s, first forward + backward"), gpus=0),
    Benchmark("quantize_ffn", "Quantize: SwiGLU FFN, bf16 peers vs torchao by hand vs xform",
              (("bench/quantize.py", "--model", "ffn"),), ("--recipes", "all"),
              ("--recipes", "float8-tensorwise,float8-dynamic", "--rounds", "1"), QUANTIZE_CHART),
    Benchmark("quantize_block", "Quantize: one llama decoder block",
              (("bench/quantize.py", "--model", "block"),),
              ("--recipes", "float8-tensorwise,float8-rowwise,float8-rowwise-gw-hp,float8-dynamic", "--rounds", "3"),
              ("--recipes", "float8-tensorwise", "--rounds", "1"), QUANTIZE_CHART),
    Benchmark("attention", "Attention: SDPA as written vs flex_attention by hand vs xform vs ThunderFX",
              (("bench/attention.py",),), (), ("--seq", "1024", "--masks", "causal,document", "--modes", "fwd+bwd"),
              Chart(("seq", "mask", "mode"), ("as written", "flex triton", "flex flash", "xform", "xform new ids",
                                              "thunder"), "ms")),
    *(Benchmark(f"cudagraphs_decode_{variant}", f"CUDA graphs: decode step time, {title}",
                (("bench/cudagraphs.py", "--only", f"decode:{variant}"),), (), ("--only", f"decode:{variant}:1"),
                DECODE_CHART, table="summary") for variant, title in (("plain", "as written"),
                                                                     ("sync", "with a host sync in every layer"))),
    Benchmark("cudagraphs_memory", "CUDA graphs: peak reserved memory where graph pools cost",
              (("bench/cudagraphs.py", "--only", "memory", "--jobs", "6"),), (), ("--only", "memory:buckets:"),
              Chart(("case",), ("inductor GiB", "reduce-overhead GiB", "xform GiB"), "GiB peak reserved"),
              table="summary"),
    Benchmark("distribute", "Distribute: xform vs FSDP2 / DDP / tensor parallelism by hand",
              tuple(("bench/distribute.py", "--strategy", s) for s in ("ddp", "fsdp", "tp", "fsdp+tp")), (),
              ("--layers", "2", "--dim", "1024", "--seq", "512", "--steps", "3"),
              Chart(("strategy",), ("step_ms",), "ms a training step", series="way"), gpus=2),
)


# ----- running

def cuda_devices() -> int:
    """The CUDA GPUs here (this process only counts them; it makes no CUDA context of its own)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def command(bench: Benchmark, run: tuple[str, ...], quick: bool, out: Path, gpus: int) -> list[str]:
    launcher = [sys.executable]
    if bench.gpus > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(gpus)]
    script, *arguments = run
    return [*launcher, str(ROOT / script), *arguments, *(bench.quick if quick else bench.full), "--out", str(out)]


def shown(argv: Sequence[str]) -> str:
    """A command as a reader would type it in the repository root."""
    return " ".join("python" if a == sys.executable else a.replace(f"{ROOT}{os.sep}", "") for a in argv)


def run_process(argv: list[str], log: Path, timeout: float | None) -> str | None:
    """Run one benchmark process, its output appended to `log`; None when it succeeded, else what
    went wrong. A process past `timeout` is ended with the processes it started (its own session)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with log.open("a") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return f"timed out after {timeout:g} s"
    return None if code == 0 else f"exit status {code}"


def run_benchmark(bench: Benchmark, out: Path, quick: bool, timeout: float | None, gpus: int) -> dict[str, Any]:
    """Run every process of one benchmark; what became of it, also written to out/run_all/<name>.json."""
    record: dict[str, Any] = {"name": bench.name, "quick": quick, "commands": []}
    if gpus < bench.gpus:
        record.update(status="skipped", reason=f"needs {bench.gpus} CUDA GPU(s), this machine has {gpus}")
    else:
        log = out / "logs" / f"{bench.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        start, failures = time.perf_counter(), []
        for run in bench.runs:
            argv = command(bench, run, quick, out, gpus)
            record["commands"].append(shown(argv))
            failure = run_process(argv, log, timeout)
            if failure:
                failures.append(f"{' '.join(run)}: {failure}")
        record.update(status="failed" if failures else "ran", reason="; ".join(failures) or None,
                      seconds=round(time.perf_counter() - start, 1), log=str(log.relative_to(out)))
    record["finished"] = utc_stamp(time.time())
    tqdm.write(f"{bench.name}: {record['status']}" + (f" ({record['reason']})" if record.get("reason") else ""))
    sys.stdout.flush()  # a run cut short keeps its log
    (out / "run_all").mkdir(parents=True, exist_ok=True)
    (out / "run_all" / f"{bench.name}.json").write_text(json.dumps(record, indent=2))
    return record


# ----- rendering

def load_results(out: Path, bench: Benchmark) -> dict[str, dict[str, Any]]:
    """The JSON results a benchmark wrote into `out`, by file stem."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob(f"{bench.name}*.json"))}


def load_record(out: Path, bench: Benchmark) -> dict[str, Any] | None:
    path = out / "run_all" / f"{bench.name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def cell(value: Any) -> str:
    """A value as one markdown table cell: one line, no pipes, at most CELL_CHARS characters."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 3] + "..."


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every column any row has, in the order they first appear."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return tabulate([[cell(row.get(c)) for c in columns] for row in rows], headers=[cell(c) for c in columns],
                    tablefmt="github", disable_numparse=True)


def points(rows: Sequence[dict[str, Any]], chart: Chart) -> list[tuple[str, str, float]]:
    """(group, bar, height) for every numeric value the chart draws; skips, errors and blanks drop out."""
    found = []
    for row in rows:
        group = " ".join(str(row.get(c, "")) for c in chart.label)
        for column in chart.values:
            value = row.get(column)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found.append((group, str(row.get(chart.series)) if chart.series else column, float(value)))
    return found


def draw_chart(title: str, chart: Chart, rows: Sequence[dict[str, Any]], path: Path) -> str | None:
    """Write the bar chart to `path`; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib does not import here ({error}); install the extra: pip install -e \".[bench]\""
    found = points(rows, chart)
    if not found:
        return "no numeric values to chart"
    groups = list(dict.fromkeys(g for g, _, _ in found))
    bars = list(dict.fromkeys(b for _, b, _ in found))
    width = 0.8 / len(bars)
    figure, axes = plt.subplots(figsize=(max(6.0, 0.5 * len(groups) * len(bars) + 2), 4.5))
    for i, bar in enumerate(bars):
        heights = {g: v for g, b, v in found if b == bar}
        xs = [j + (i - (len(bars) - 1) / 2) * width for j, g in enumerate(groups) if g in heights]
        axes.bar(xs, [heights[g] for g in groups if g in heights], width, label=bar)
    axes.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    axes.set_ylabel(f"{chart.unit} (lower is better)")
    axes.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None


def environment_line(result: dict[str, Any]) -> str:
    env = result.get("environment", {})
    return f"{env.get('gpu') or 'CPU'}, torch {env.get('torch')}, Python {env.get('python')}"


def notes(result: dict[str, Any], bench: Benchmark) -> list[str]:
    """What else the JSON says beside its rows (recipes refused and why, a partial run), as bullets."""
    shown = {"benchmark", "environment", "rows", bench.table}
    return [f"- {key}: {cell(value)}" for key, value in result.items()
            if key not in shown and value not in (None, {}, [], "")]


def result_text(stem: str, result: dict[str, Any], bench: Benchmark, several: bool) -> list[str]:
    lines = [f"#### `{stem}.json`", ""] if several else []
    lines += [f"Measured on {environment_line(result)}.", ""]
    rows = result.get(bench.table) or []
    lines += [markdown_table(rows) if rows else "(no rows)", ""]
    extra = notes(result, bench)
    return lines + (extra + [""] if extra else [])


def utc_stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def measured_on(out: Path, bench: Benchmark, record: dict[str, Any] | None) -> str:
    """When the benchmark's results were measured: its record's end, else its newest JSON file's
    time (a record of an older run_all), not when they are rendered."""
    if record and record.get("finished"):
        return record["finished"]
    files = [*out.glob(f"{bench.name}*.json"), *([out / "run_all" / f"{bench.name}.json"] if record else [])]
    return utc_stamp(max(f.stat().st_mtime for f in files)) if files else "an unknown time"


def section(bench: Benchmark, out: Path, docs: Path, charts: Path) -> str:
    """One benchmark's markdown: when and how it ran, its tables and its chart (or why there is none)."""
    record, results = load_record(out, bench), load_results(out, bench)
    lines = [f"### {bench.title}", "", f"{RAN_ON} {measured_on(out, bench, record)}, results in `{out}`."]
    if record:
        lines += [f"Status: {record['status']}" + (f" ({record['reason']})" if record.get("reason") else "")
                  + (", `--quick`" if record.get("quick") else "") + "."]
        lines += [f"Command: `{c}`" for c in record["commands"]]
    lines += [""]
    if not results:
        return "\n".join(lines + [f"No results in `{out}`.", ""])
    for stem, result in results.items():
        lines += result_text(stem, result, bench, len(results) > 1)
    rows = [row for result in results.values() for row in result.get(bench.table) or []]
    chart_path = charts / f"{bench.name}.png"
    why_not = draw_chart(bench.title, bench.chart, rows, chart_path)
    link = os.path.relpath(chart_path, docs.parent)
    lines += [f"![{bench.name}]({link})" if why_not is None else f"Chart skipped: {why_not}.", ""]
    return "\n".join(lines)


def earlier_sections(text: str) -> dict[str, str]:
    """The sections a last run rendered between the markers, by title, each with the line saying when
    it ran (a section of the older format, one date for the whole block, is given that date)."""
    if BEGIN not in text or END not in text:
        return {}
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    old_header = re.search(r"Generated (.+?) by `python bench/run_all.py` from the results in `([^`]*)`", block)
    sections = {}
    for part in re.split(r"^(?=### )", block, flags=re.M)[1:]:
        title, _, body = part.strip().partition("\n")
        if RAN_ON not in body and old_header:
            body = f"\n{RAN_ON} {old_header[1]}, results in `{old_header[2]}`." + body
        sections[title[4:]] = f"{title}\n{body.rstrip()}\n"
    return sections

def replace_generated(text: str, generated: str) -> str:
    """`text` with what lies between the markers replaced by `generated`; the markers are added at
    the end where missing. Everything outside them is kept as it was."""
    block = f"{BEGIN}\n{generated.strip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def render(benchmarks: Sequence[Benchmark], out: Path, docs: Path, charts: Path,
           chosen: Sequence[Benchmark] | None = None) -> None:
    """Write the generated block of `docs`: a fresh section for each benchmark with a record or results
    in `out`; for the others the section their last run rendered, kept with its date (device calls
    and sessions each run some benchmarks), else, for those `chosen` to run, a line saying none came."""
    text = docs.read_text() if docs.exists() else ""
    kept = earlier_sections(text)
    stamp = utc_stamp(time.time())
    parts = [f"Generated by `python bench/run_all.py`, last on {stamp}. Each section says when its results were "
             "measured: a benchmark not run since keeps its section from the run that measured it.", ""]
    for bench in benchmarks:
        if load_record(out, bench) or load_results(out, bench) or (bench.title not in kept and
                                                                  (chosen is None or bench in chosen)):
            parts.append(section(bench, out, docs, charts))
        elif bench.title in kept:
            parts.append(kept[bench.title])
    docs.write_text(replace_generated(text, "\n".join(parts)))
    print("wrote", docs, flush=True)


# ----- command line

def selected(benchmarks: Sequence[Benchmark], only: str | None, skip: str | None) -> list[Benchmark]:
    names = {b.name for b in benchmarks}
    wanted = {n for n in (only or "").split(",") if n} or names
    dropped = {n for n in (skip or "").split(",") if n}
    unknown = (wanted | dropped) - names
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; known: {', '.join(b.name for b in benchmarks)}")
    return [b for b in benchmarks if b.name in wanted - dropped]


def main(argv: Sequence[str] | None = None, benchmarks: Sequence[Benchmark] = BENCHMARKS) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results folder")
    parser.add_argument("--only", help="comma-separated benchmark names to run")
    parser.add_argument("--skip", help="comma-separated benchmark names not to run")
    parser.add_argument("--quick", action="store_true", help="fewer configurations and smaller sizes")
    parser.add_argument("--render-only", action="store_true", help="render the results already in --out")
    parser.add_argument("--timeout", type=float, help="seconds each benchmark process may run")
    parser.add_argument("--docs", type=Path, default=DOCS, help="markdown file to write the section into")
    parser.add_argument("--charts", type=Path, help="folder for the PNG charts (default: charts/ beside --docs)")
    args = parser.parse_args(argv)
    chosen = selected(benchmarks, args.only, args.skip)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        gpus = cuda_devices()
        for bench in tqdm(chosen, desc="benchmarks", unit="benchmark", disable=None):
            run_benchmark(bench, args.out, args.quick, args.timeout, gpus)
    render(benchmarks, args.out, args.docs, args.charts or args.docs.parent / "charts", chosen)


if __name__ == "__main__":
    main()
