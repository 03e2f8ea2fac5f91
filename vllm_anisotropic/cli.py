"""Command-line entry point: ``vllm-anisotropic <command> ...``.

Each command lives in its own module and contributes ``add_parser(subparsers)``; the parser it
adds sets ``func`` (called with the parsed namespace, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module path -> imported lazily so that ``--help`` stays fast and vLLM is imported only by
# the commands that run it.
COMMAND_MODULES = (
    "vllm_anisotropic.models.cli",
    "vllm_anisotropic.data.cli",
    "vllm_anisotropic.bench.demo",
    "vllm_anisotropic.bench.sweep",
    "vllm_anisotropic.bench.profile_host",
    "vllm_anisotropic.bench.tau",
    "vllm_anisotropic.bench.crosscheck",
    "vllm_anisotropic.bench.tree_attention_check",
    "vllm_anisotropic.bench.verify_cost",
    "vllm_anisotropic.selector.train",
    "vllm_anisotropic.integration.vllm.frontdoor.serve_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-anisotropic",
        description="Tree speculative decoding for vLLM: models, datasets, benchmarks.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
