"""The command line: `python -m xform explain TARGET [--transforms SPECS]` (see xform/explainer.py)."""

from __future__ import annotations

import argparse
import sys

from xform.registry import TransformNotAvailable


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m xform", description="xform's command line")
    commands = top.add_subparsers(dest="command", required=True)
    explain = commands.add_parser(
        "explain", help="what each transform would do to a model, and every CUDA-graph break, without a GPU",
        description="Print what each transform would do to a model (changed, skipped and why) and every op a "
                    "CUDA graph cannot record (your line, the reason, the fix), without a GPU.")
    explain.add_argument("target", help="SCRIPT.py:FUNCTION or MODULE:FUNCTION; FUNCTION() returns (model, args) or "
                                        "(model, args, kwargs)")
    explain.add_argument("--transforms", help="comma-separated specs, e.g. cast:bf16,flex-attention,cudagraphs "
                                              "(default: the transforms that make sense for the model's mode)")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from xform.explainer import explain_target  # imports torch: after the arguments are known good

    try:
        for section in explain_target(args.target, args.transforms):
            print(section, flush=True)
    except (ValueError, TransformNotAvailable) as error:  # a bad target or spec: the message says what to change
        print(f"xform explain: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
