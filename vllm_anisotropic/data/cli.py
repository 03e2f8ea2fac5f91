"""``vllm-anisotropic datasets {list,show}``: inspect the offline benchmark prompt sets."""

from __future__ import annotations

import argparse
import sys


def _cmd_list(args: argparse.Namespace) -> int:
    from vllm_anisotropic.data.datasets import DATASETS, dataset_file
    from vllm_anisotropic.models.packages import MissingPackageError

    for name, source in DATASETS.items():
        try:
            dataset_file(name)
            state = "installed"
        except MissingPackageError:
            state = f"missing: {source.pip_command}"
        print(f"{name:10} {source.expected:5d} prompts  {source.distribution:26} [{state}]")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from vllm_anisotropic.data.datasets import load_dataset

    tokenizer = None
    if args.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    for prompt in load_dataset(args.name, limit=args.limit):
        print(f"=== {prompt.id}")
        if tokenizer is not None:
            from vllm_anisotropic.data.formatting import format_prompt

            print(format_prompt(prompt, tokenizer, args.mode))
        else:
            for i, turn in enumerate(prompt.turns or (prompt.text,)):
                print(f"--- turn {i + 1}\n{turn}")
        if prompt.reference is not None:
            print(f"--- reference\n{prompt.reference}")
    return 0


def _guard(func):
    def run(args: argparse.Namespace) -> int:
        from vllm_anisotropic.models.packages import MissingPackageError

        try:
            return func(args)
        except (MissingPackageError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return run


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "datasets",
        help="list / show the benchmark prompt sets (HumanEval, MBPP, GSM8K, MATH500, MT-Bench)",
    )
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    sub = parser.add_subparsers(dest="datasets_command")

    p = sub.add_parser("list", help="list data sets, sizes and whether their package is installed")
    p.set_defaults(func=_guard(_cmd_list))

    p = sub.add_parser("show", help="print the first prompts of a data set")
    p.add_argument("name")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--model", default=None, help="model directory: print the formatted prompt")
    p.add_argument("--mode", choices=["chat", "raw"], default="chat")
    p.set_defaults(func=_guard(_cmd_show))
    return parser
