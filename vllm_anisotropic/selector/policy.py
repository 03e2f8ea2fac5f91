"""The (K, L1, L2) selector: root features -> one delayed-tree shape (arXiv 2602.16994 Sec. 6, App. E).

A small MLP (standardized scalar features -> GELU 64 -> GELU 32 -> one logit per action) over a
fixed grid of actions; at run time one action per engine step, the one with the highest summed
log-policy over the step's requests (``ShapeSelector.choose_shapes``; one request: its argmax).
Only the paper's scalar features (``selector.features``): its hidden-state projections are left
out (they need the target's hidden state at the preceding token, which this engine's drafter
does not see).

File format (a directory; never pickle)::

    selector.json          format, version, features (names, mean, std), actions, verifier,
                           hidden sizes, the pair it was trained for, the sha256 of the weights,
                           the training summary, draft_quantization (what q ran in when timed),
                           max_batch_size (optional: no drafting in wider steps)
    selector.safetensors   the MLP's tensors

``ShapeSelector.load`` refuses (``SelectorFileError``, naming the file and the problem) a missing
file, a file of another format or version, features this code does not compute, actions outside
the paper's grid, weights whose checksum or shapes do not match, a max_batch_size that is not an
integer >= 1.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm_anisotropic.selector.features import FEATURES, features_of
from vllm_anisotropic.selector.shape import DelayedShape

__all__ = ["FORMAT", "VERSION", "SelectorFileError", "SelectorNet", "ShapeSelector", "action_grid", "in_paper_grid"]

FORMAT = "vllm-anisotropic-shape-selector"
VERSION = 1
JSON_NAME, WEIGHTS_NAME = "selector.json", "selector.safetensors"
HIDDEN = (64, 32)
ENTROPY_PROBES = 33  # root entropies ``ShapeSelector.may_draft`` tries before q's root forward
# arXiv 2602.16994 Eq. 8: K in 1..4, L1 and L2 in 0..8
K_MAX, L1_MAX, L2_MAX = 4, 8, 8


class SelectorFileError(ValueError):
    """A selector file that cannot be used (missing, corrupted, of another version or grid)."""


def in_paper_grid(action: tuple[int, int, int]) -> bool:
    k, l1, l2 = action
    return 1 <= k <= K_MAX and 0 <= l1 <= L1_MAX and 0 <= l2 <= L2_MAX and not (l2 == 0 and k > 1)


def action_grid(max_drafts: int | None = None) -> list[tuple[int, int, int]]:
    """The paper's actions without duplicates (K > 1 with L2 = 0 is the K = 1 chain), in (K, L1,
    L2) order, at most ``max_drafts`` drafts each: ``len(action_grid()) == 297``."""
    out = [(k, l1, l2) for k in range(1, K_MAX + 1) for l1 in range(L1_MAX + 1) for l2 in range(L2_MAX + 1)]
    return [a for a in out if in_paper_grid(a) and (max_drafts is None or a[1] + a[0] * a[2] <= max_drafts)]


class SelectorNet(torch.nn.Module):
    def __init__(self, num_features: int, num_actions: int, hidden: tuple[int, ...] = HIDDEN) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.GELU()]
            width = h
        layers.append(torch.nn.Linear(width, num_actions))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


@dataclass
class ShapeSelector:
    net: SelectorNet
    mean: np.ndarray  # [F] feature standardization
    std: np.ndarray
    actions: list[tuple[int, int, int]]
    verifier: str
    meta: dict = field(default_factory=dict)  # pair, training summary (written to the JSON)

    @property
    def max_drafts(self) -> int:
        return max(l1 + k * l2 for k, l1, l2 in self.actions)

    @property
    def draft_quantization(self) -> str:
        """What q's linear layers ran in when the labels' pass times were measured (``selector
        train`` writes it from the timing record; ``"none"`` for a file from before the key)."""
        return self.meta.get("draft_quantization", "none")

    @property
    def max_batch_size(self) -> int | None:
        """The most requests an engine step may have, drafting or not, for this selector to draft
        at all (``selector train --max-batch-size``, from runs in vLLM by concurrency: what the
        labels leave out, q's catch-up of new prompts above all, can make a wide batch's drafting
        lose although its labels pay); None: no bound."""
        return self.meta.get("max_batch_size")

    @torch.no_grad()
    def logits(self, features: np.ndarray) -> torch.Tensor:
        """[n, A] logits of raw features [n, F] (or [F])."""
        x = (np.atleast_2d(np.asarray(features, np.float64)) - self.mean) / self.std
        return self.net(torch.as_tensor(x, dtype=torch.float32))

    def choose_index(self, features: np.ndarray) -> np.ndarray:
        """[n] index into ``actions`` of each row's choice (argmax; ties to the lower index)."""
        return self.logits(features).argmax(-1).numpy()

    def choose(self, features: np.ndarray) -> DelayedShape:
        """The shape of one request-step (``features`` [F] or [1, F])."""
        return self.choose_shapes(np.atleast_2d(features))[0]

    def choose_shapes(self, features: np.ndarray) -> list[DelayedShape]:
        """The shapes of the requests of one engine step (``features`` [n, F], row r request r's):
        one shape for all of them, the action with the highest sum over the rows of log pi(a | c_r)
        (ties to the lower index; one row: ``choose_index``'s). Why one: the engine's batched step
        runs max L1 + max L2 forwards of q for all its requests (``proposers/draft_batch.py``), and
        the labels price a request of a b-request step as if all b drafted its shape
        (``train.step_time``); per-request choices mix shapes that the step then pays at the deepest
        (held out, ``train.step_scores``: docs/selector.md)."""
        index = int(self.logits(features).log_softmax(-1).sum(0).argmax())
        k, l1, l2 = self.actions[index]
        return [DelayedShape(branches=k, trunk=l1, branch_length=l2)] * len(features)

    def may_draft(self, context_len: int, temperature: float, top_p: float, batch_size: int,
                  batch_requests: int | None = None) -> bool:
        """Whether some root entropy of q makes the selector draft here (``may_draft_rows`` of one
        request)."""
        return bool(self.may_draft_rows([context_len], [temperature], [top_p], batch_size, batch_requests)[0])

    def may_draft_rows(self, context_lens, temperatures, top_ps, batch_size: int,
                       batch_requests: int | None = None) -> np.ndarray:
        """[n] bool: for request r of a step (its context length, temperature, top-p), whether some
        root entropy of q makes the selector draft. Everything but the entropy is known before q
        runs; when no entropy (``ENTROPY_PROBES`` values over the training mean +- 4 standard
        deviations) gives a shape with drafts, the drafter skips q's root forward and decodes the
        step plainly, as the selector would have chosen (e.g. a wide batch, where each request's
        drafting costs more than the shared verification saves). One pass of the network for the
        whole step, not one per request. ``batch_size``: the step's drafting requests (the
        feature); ``batch_requests``: all its requests (None: ``batch_size``), none of which
        drafts when they are more than ``max_batch_size``."""
        n = len(context_lens)
        if self.max_batch_size is not None and max(batch_size, batch_requests or 0) > self.max_batch_size:
            return np.zeros(n, bool)
        col = FEATURES.index("entropy_q")
        mean, std = float(self.mean[col]), float(self.std[col])
        rows = np.repeat(np.stack([features_of(0.0, c, t, p, batch_size)
                                   for c, t, p in zip(context_lens, temperatures, top_ps)]), ENTROPY_PROBES, axis=0)
        rows[:, col] = np.tile(np.linspace(max(0.0, mean - 4 * std), mean + 4 * std, ENTROPY_PROBES), n)
        drafts = np.array([l1 + k * l2 > 0 for k, l1, l2 in self.actions])
        return drafts[self.choose_index(rows)].reshape(n, ENTROPY_PROBES).any(axis=1)

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights = directory / WEIGHTS_NAME
        save_file({k: v.contiguous() for k, v in self.net.state_dict().items()}, str(weights))
        weights.chmod(0o644)  # safetensors writes 0600; a shipped or shared selector is read by others
        doc = {
            "format": FORMAT, "version": VERSION,
            "features": list(FEATURES), "feature_mean": [float(v) for v in self.mean],
            "feature_std": [float(v) for v in self.std],
            "actions": [list(a) for a in self.actions], "verifier": self.verifier, "hidden": list(HIDDEN),
            "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), **self.meta,
        }
        (directory / JSON_NAME).write_text(json.dumps(doc, indent=1) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "ShapeSelector":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        meta_path, weights = directory / JSON_NAME, directory / WEIGHTS_NAME
        for path in (meta_path, weights):
            if not path.is_file():
                raise SelectorFileError(f"selector {str(directory)!r}: {path.name} is missing (a selector is a "
                                        f"directory with {JSON_NAME} and {WEIGHTS_NAME}, from `vllm-anisotropic selector train`)")
        try:
            doc = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SelectorFileError(f"selector {str(meta_path)!r} is not valid JSON: {e}") from None
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise SelectorFileError(f"selector {str(meta_path)!r} has format {doc.get('format')!r} version "
                                    f"{doc.get('version')!r}; this vllm-anisotropic reads {FORMAT!r} version {VERSION}")
        if doc.get("features") != list(FEATURES):
            raise SelectorFileError(f"selector {str(meta_path)!r} was trained on features {doc.get('features')}; "
                                    f"this vllm-anisotropic computes {list(FEATURES)}")
        actions = [tuple(int(v) for v in a) for a in doc.get("actions", [])]
        bad = [a for a in actions if len(a) != 3 or not in_paper_grid(a)]
        if not actions or bad:
            raise SelectorFileError(f"selector {str(meta_path)!r}: actions {bad or '[]'} are outside the (K, L1, L2) "
                                    f"grid K 1..{K_MAX}, L1 0..{L1_MAX}, L2 0..{L2_MAX} (K 1 when L2 is 0)")
        cap = doc.get("max_batch_size")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise SelectorFileError(f"selector {str(meta_path)!r}: max_batch_size {cap!r} is not an integer >= 1 "
                                    f"(or absent: no bound)")
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        if digest != doc.get("weights_sha256"):
            raise SelectorFileError(f"selector {str(weights)!r} does not match the checksum in {JSON_NAME} "
                                    f"(sha256 {digest[:12]}..., expected {str(doc.get('weights_sha256'))[:12]}...): "
                                    f"corrupted or replaced")
        net = SelectorNet(len(FEATURES), len(actions), tuple(doc.get("hidden", HIDDEN)))
        try:
            net.load_state_dict(load_file(str(weights)))
        except (RuntimeError, SafetensorError) as e:
            raise SelectorFileError(f"selector {str(weights)!r} does not fit its {JSON_NAME}: {e}") from None
        known = {"format", "version", "features", "feature_mean", "feature_std", "actions", "verifier", "hidden",
                 "weights_sha256"}
        return cls(net=net.eval(), mean=np.asarray(doc["feature_mean"], np.float64),
                   std=np.asarray(doc["feature_std"], np.float64), actions=actions, verifier=str(doc["verifier"]),
                   meta={k: v for k, v in doc.items() if k not in known})
