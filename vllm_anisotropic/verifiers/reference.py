"""Slow reference of the top-down verifiers: a plain Python loop per tree and per node.

Scope: test oracles for the vectorised verifiers (``Verifier.reference_batch``; the bottom-up
traversal and block verifiers keep their own ``reference_tree``). They read the same uniform block ``u`` in
the same layout, so on a fixed seed the fast and the reference implementation must return
identical paths and bonus tokens (``tests/test_verifier_reference.py``). Per-node vector
arithmetic over the vocabulary uses torch on 1-D rows; all control flow is Python.
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.base import VerifyResult
from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf

__all__ = ["topdown_tree"]


def topdown_tree(verifier, nodes, batch, logits, sampling_b, q, u_b) -> VerifyResult:
    """Walk one tree top-down, calling the verifier's per-node ``solve_reference``
    (``TopDownVerifier.reference_tree``; ``sampling_b``: the tree's one-row ``SamplingTensors``)."""
    root = nodes[0]
    table = batch.children if verifier.use_children else batch.slots
    s = table.shape[1]
    cur, path = root, []
    for t in range(batch.max_depth + 1):
        target = verifier.node_target(logits[cur : cur + 1], sampling_b)[0]
        slot_nodes = [int(n) for n in table[cur].tolist() if n >= 0]
        if verifier.shuffle:  # uniformly random order of the i.i.d. multiset
            keys = u_b[t, : len(slot_nodes)].tolist()
            slot_nodes = [n for _, n in sorted(zip(keys, slot_nodes), key=lambda kv: kv[0])]
        xs = [int(batch.tokens[n]) for n in slot_nodes]
        if not slot_nodes:
            if hasattr(verifier, "bonus_reference"):
                y = verifier.bonus_reference(target, u_b[t, 3 * s + 1])
            else:
                y = int(sample_inverse_cdf(target.unsqueeze(0), u_b[t, 3 * s + 1].reshape(1))[0])
        else:
            qc = None if q is None else q[cur].to(verifier.dtype)
            y = verifier.solve_reference(target, qc, xs, u_b[t], s)
        cands = slot_nodes[:1] if verifier.single_path else [int(c) for c in batch.children[cur].tolist() if c >= 0]
        nxt = next((c for c in cands if int(batch.tokens[c]) == y), None)
        if nxt is None:
            return VerifyResult(path, y)
        path.append(nxt - root)
        cur = nxt
    raise AssertionError("walked past the deepest node")
