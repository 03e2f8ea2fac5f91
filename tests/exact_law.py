"""The target's exact next-token law along sampled outputs, and a test of it with stated power.

A two-sample test (tree samples against plain vLLM's samples) needs tens of thousands of samples a
side to see a small bias: past the first tokens, sampled outputs spread over many prefixes and the
marginal law of each position is flat. This module tests the *conditional* law instead. For every
emitted token x_t of every sampled output, the target model (run here in float32 by transformers,
independently of vLLM) gives the law pi_t the request samples from at that prefix, processed as
vLLM's sampler processes it (``processed_probs``: logit bias, temperature, min_p, top-k / top-p).
Under the null hypothesis that the engine samples from pi_t, with p_t = max pi_t,

    S = sum_t w_t (1[x_t = argmax pi_t] - p_t),    w_t = 1 / max(1 - p_t, 0.05)

is a sum of martingale differences with conditional variances w_t^2 p_t (1 - p_t), so
z = S / sqrt(sum_t w_t^2 p_t (1 - p_t)) is approximately standard normal (martingale central
limit theorem), however the outputs' prefixes depend on each other and on the tree. The weight is
the score of a relative bias b of the top token, d/db log-likelihood at b = 0, (hit - p) / (1 - p),
capped where p > 0.95 (a +5 % bias cannot lift those past 1, and an uncapped weight would let a
few near-certain tokens dominate); unweighted, a run's many near-certain tokens dilute the
evidence (2,000 simulated tokens with top probabilities like a run's: power 0.66 unweighted, 0.99
weighted; ``test_exact_law.py``). ``|z| >= 4`` fails a test:
false-alarm rate 6.3e-5 under the normal law, ~1e-4 simulated on the runs' own p_t (the capped
weights make the tails a little heavier; ``LawCheck.false_alarm_rate``).

Power (``LawCheck.power``): the engine samples the most likely token with probability
min(1, (1 + b) p_t) instead of p_t (b = +5 % and -5 %, the mass moved from or to the other
tokens), simulated on the very p_t of the run: the fraction of simulated runs with ``|z| >= 4``,
the smaller of the two. The weights depend on p_t only, never on the emitted tokens, and were
chosen on a plain run (temperature 0.8), not on the runs the tests judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

THRESHOLD = 4.0


def processed_probs(logits, temperature: float, top_p: float | None = None, top_k: int | None = None,
                    min_p: float | None = None, logit_bias: dict[int, float] | None = None,
                    candidates: int = 256, allowed=None):
    """Probabilities vLLM 0.32's sampler draws a token from, given float32 ``logits``
    ``[num_rows, vocab_size]``, in its order: the structured-output grammar's mask (``allowed``
    ``[num_rows, vocab_size]`` bool, applied by the runner before the sampler), logit bias (a
    logits processor), temperature, min_p
    (argmax-invariant, on the tempered probabilities: tokens below ``min_p`` times the largest go),
    then top-k / top-p with ``apply_top_k_top_p``'s rule: top-k keeps the tokens at least as
    likely as the k-th; top-p sorts ascending and drops every token whose cumulative
    probability (itself included) is at most 1 - p, the most likely always kept. A token of
    descending rank r has ascending cumulative probability 1 - (mass ranked above it), so it stays
    iff the mass above it is < p: decided from the ``candidates`` most likely tokens of each row
    (a full-vocabulary sort, as vLLM does it, costs ~15 s for 9,600 rows here); rows whose
    candidates hold less than p fall back to vLLM's own function. Equal to it up to float
    rounding at the boundary (``test_exact_law.py``)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = logits.float().clone()
    if allowed is not None:
        logits[~torch.as_tensor(allowed)] = -float("inf")
    for token, bias in (logit_bias or {}).items():
        logits[:, int(token)] += bias
    logits /= temperature
    if min_p:
        probs = logits.softmax(-1)
        logits[probs < min_p * probs.amax(-1, keepdim=True)] = -float("inf")
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [num_rows, 1]
        logits[logits < kth] = -float("inf")
    probs = logits.softmax(-1)  # [num_rows, vocab_size]
    if top_p is None or top_p >= 1.0:
        return probs
    top, idx = probs.topk(min(candidates, probs.shape[-1]), dim=-1)  # [num_rows, candidates], descending
    above = top.cumsum(-1) - top  # the mass ranked above each candidate
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, idx, above < top_p)
    out = logits.masked_fill(~kept, -float("inf")).softmax(-1)
    short = (top.sum(-1) < top_p).nonzero().squeeze(-1)  # rows whose candidates hold less than p
    if short.numel():
        p = torch.full((short.numel(),), top_p, dtype=torch.float32)
        out[short] = apply_top_k_top_p_pytorch(logits[short].clone(), None, p).softmax(-1)
    return out


@dataclass
class LawCheck:
    """Per emitted token: ``top`` = the probability pi_t gives its rank-r token, ``hit`` = whether
    the engine emitted that token (r = 1: the statistic above; r = 2: the same test of the second
    most likely token, which sees mass moved between the runners-up that rank 1 cannot see)."""

    top: np.ndarray
    hit: np.ndarray

    @property
    def weight(self) -> np.ndarray:
        return 1.0 / np.maximum(1.0 - self.top, 0.05)

    def _z(self, hit: np.ndarray) -> np.ndarray:
        w = self.weight
        return ((hit - self.top) * w).sum(-1) / np.sqrt((w * w * self.top * (1 - self.top)).sum())

    @property
    def z(self) -> float:
        return float(self._z(self.hit))

    def _simulated_z(self, bias: float, runs: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        q = np.clip(self.top * (1 + bias), 0.0, 1.0)
        return self._z(rng.random((runs, self.top.size)) < q)

    def rejection_rate(self, bias: float, runs: int = 1000, seed: int = 0) -> float:
        """Probability that ``|z| >= THRESHOLD`` when the engine emits the top token with
        probability min(1, (1 + bias) p_t)."""
        return float((abs(self._simulated_z(bias, runs, seed)) >= THRESHOLD).mean())

    def power(self, relative_bias: float = 0.05) -> float:
        """The smaller rejection rate of a bias of ``+relative_bias`` and ``-relative_bias``."""
        return min(self.rejection_rate(relative_bias), self.rejection_rate(-relative_bias))

    def false_alarm_rate(self, runs: int = 10000, seed: int = 1) -> float:
        return float((abs(self._simulated_z(0.0, runs, seed)) >= THRESHOLD).mean())

    def summary(self) -> str:
        return (f"{self.top.size} tokens, mean top probability {self.top.mean():.3f}, z {self.z:+.2f}, "
                f"power vs 5% bias {self.power():.3f}, simulated false alarms {self.false_alarm_rate():.5f}")


def check_outputs(model_dir: str | Path, prompt_ids: list[list[int]], outputs: list[list[int]],
                  rows_per_chunk: int = 32, masks=None, **sampling) -> tuple[LawCheck, LawCheck]:
    """``LawCheck`` of the most likely and of the second most likely token for sampled ``outputs``
    (one per prompt of ``prompt_ids``) against the law the target gives each of their prefixes;
    ``masks``: per output, its grammar's ``[len(output), vocab_size]`` bool allowed tokens (a
    structured output), or None; ``sampling``: ``processed_probs``' keywords."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tops, hits = [], []
    masks = [None] * len(outputs) if masks is None else masks
    pairs = [(p, o, m) for p, o, m in zip(prompt_ids, outputs, masks) if o]
    with torch.inference_mode():
        for start in range(0, len(pairs), rows_per_chunk):
            chunk = pairs[start:start + rows_per_chunk]
            width = max(len(p) + len(o) - 1 for p, o, _ in chunk)
            # right padding: a causal model's logits at a position never read later positions
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (p, o, _) in enumerate(chunk):
                seq = p + o[:-1]
                ids[i, :len(seq)] = torch.tensor(seq)
            hidden = model.model(input_ids=ids).last_hidden_state  # [rows, width, hidden]
            rows = [hidden[i, len(p) - 1:len(p) - 1 + len(o)] for i, (p, o, _) in enumerate(chunk)]
            allowed = None if chunk[0][2] is None else torch.from_numpy(np.concatenate([m for _, _, m in chunk]))
            probs = processed_probs(model.lm_head(torch.cat(rows)), allowed=allowed, **sampling)  # [tokens, vocab_size]
            emitted = torch.tensor([t for _, o, _ in chunk for t in o])
            top, arg = probs.topk(2, dim=-1)  # [tokens, 2]
            tops.append(top.double().numpy())
            hits.append((arg == emitted[:, None]).numpy())
    top, hit = np.concatenate(tops), np.concatenate(hits).astype(np.float64)
    return LawCheck(top=top[:, 0], hit=hit[:, 0]), LawCheck(top=top[:, 1], hit=hit[:, 1])


def law_z(model_dir: str | Path, result, power: bool = True, masks=None, **sampling) -> list[float]:
    """|z| of the top and of the second token for an offline job's ``result`` (its first
    completions) against the exact law of ``model_dir`` under ``sampling`` (``processed_probs``'
    keywords; ``masks``: ``check_outputs``'); prints the summary; asserts the stated power (>= 0.9
    against a 5 % bias) when ``power``."""
    top, second = check_outputs(model_dir, result.prompt_token_ids, [r[0] for r in result.token_ids], masks=masks,
                                **sampling)
    print(f"exact law: top {top.summary()}; second z {second.z:+.2f}")
    if power:
        assert top.power() >= 0.9, top.summary()  # the run is informative enough for the stated power
    return [abs(top.z), abs(second.z)]


def grammar_masks(model_dir: str | Path, regex: str, outputs: list[list[int]]) -> list[np.ndarray]:
    """Per output, ``[len(output), vocab_size]`` bool: the tokens a ``regex`` structured output
    allows before each of its tokens (xgrammar, vLLM's default backend, over the model's
    tokenizer; the output's own tokens accepted one by one)."""
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(model_dir)), vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_regex(regex)
    out = []
    for output in outputs:
        matcher = xgr.GrammarMatcher(compiled)
        bits = xgr.allocate_token_bitmask(max(len(output), 1), vocab)
        for i, token in enumerate(output):
            matcher.fill_next_token_bitmask(bits, i)
            assert matcher.accept_token(token), (i, token)  # every emitted token obeys the grammar
        # bit b of int32 word w is token 32 w + b (little-endian bytes, bits least significant first)
        out.append(np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:len(output), :vocab].astype(bool))
    return out
