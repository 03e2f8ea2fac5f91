"""Block Verification of a single draft path (Sun et al. 2024, arXiv 2403.10444;
arXiv 2602.16994 Sec. 3.1).

Scope: single-path verification; on a tree it verifies the *first-child chain* (following
the first child in priority order from the root), which must be a path sampled from q
(true for unmerged i.i.d. trees and for tries built in path order, ``DraftTree.from_paths``).
The other branches are ignored. It equals Traversal Verification on a chain.

With chain X_1..X_L, p_i = p(. | X_{1:i}), q_i = q(. | X_{1:i}):

    w_0 = 1,   w_i = min(1, w_{i-1} * p_{i-1}(X_i) / q_{i-1}(X_i))        (sequence weights)
    D_i = sum_x max(0, w_i p_i(x) - q_i(x))                          (missing mass, i < L)
    h_i = D_i / (D_i + 1 - w_i)   (i < L),   h_L = w_L,   h_0 = 1
    tau = max{ i : eta_i < h_i }  with independent eta_i ~ U[0, 1)   (= try L, L-1, ... 0)
    bonus y ~ p_L if tau = L,  else  y ~ norm(max(0, w_tau p_tau - q_tau))

Uniforms: u[:, 0, i] = eta_i (i = 0..L_max), u[:, 0, L_max + 1] the bonus sample.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_anisotropic.tree import TreeBatch
from vllm_anisotropic.verifiers.base import BatchVerifyResult, Verifier, VerifyResult
from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf, target_probs

__all__ = ["BlockVerifier", "first_child_chain"]


def first_child_chain(batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chain [batch_size, L_max + 1] global nodes, -1 padded; length [batch_size] = L)."""
    bsz = batch.batch_size
    chain = torch.full((bsz, batch.max_depth + 1), -1, dtype=torch.int64, device=batch.tokens.device)
    chain[:, 0] = batch.root_index
    cur = batch.root_index.clone()
    length = torch.zeros(bsz, dtype=torch.int64, device=cur.device)
    for i in range(1, batch.max_depth + 1):
        nxt = torch.where(cur >= 0, batch.children[cur.clamp(min=0), 0], -1)
        chain[:, i] = nxt
        length += (nxt >= 0).to(torch.int64)
        cur = nxt
    lmax = int(length.max())
    return chain[:, : lmax + 1], length


class BlockVerifier(Verifier):
    name = "block"
    requires_draft_probs = True

    def uniform_shape(self, batch: TreeBatch) -> tuple[int, int]:
        return 1, batch.max_depth + 2

    def uniform_keys(self, batch: TreeBatch) -> np.ndarray:
        """eta_i keyed i, the bonus sample keyed 2**20 (its column moves with the batch's L_max)."""
        _, cols = self.uniform_shape(batch)
        keys = np.arange(cols, dtype=np.int64)
        keys[-1] = 1 << 20
        return keys[None, :]

    def _weights(self, chain, length, batch, target_logits, sampling, draft_probs):
        """p rows [B, L+1, V], q rows [B, L+1, V], w [B, L+1], h [B, L+1]."""
        bsz, l1 = chain.shape
        vocab = target_logits.shape[1]
        safe = chain.clamp(min=0)
        flat = safe.reshape(-1)
        rep = lambda t: t.repeat_interleave(l1)  # noqa: E731  per-request params per chain row
        p = target_probs(target_logits[flat], rep(sampling.temperature), rep(sampling.top_k), rep(sampling.top_p), self.dtype)
        p = p.reshape(bsz, l1, vocab)
        q = draft_probs[flat].to(self.dtype).reshape(bsz, l1, vocab)
        tiny = torch.finfo(self.dtype).tiny
        w = torch.ones(bsz, l1, dtype=self.dtype, device=p.device)
        for i in range(1, l1):
            x = batch.tokens[safe[:, i]].unsqueeze(1)
            ratio = p[:, i - 1].gather(1, x).squeeze(1) / q[:, i - 1].gather(1, x).squeeze(1).clamp(min=tiny)
            w[:, i] = torch.where(chain[:, i] >= 0, (w[:, i - 1] * ratio).clamp(max=1.0), torch.zeros_like(ratio))
        m = (w.unsqueeze(2) * p - q).clamp(min=0)  # [B, L+1, V] missing mass per node
        dsum = m.sum(dim=2)
        h = torch.where(dsum > 0, dsum / (dsum + 1.0 - w), torch.zeros_like(dsum))
        idx = torch.arange(l1, device=p.device).unsqueeze(0)
        h = torch.where(idx == length.unsqueeze(1), w, h)  # leaf: h_L = w_L
        h = torch.where(idx > length.unsqueeze(1), torch.zeros_like(h), h)
        h[:, 0] = torch.where(length > 0, h[:, 0], torch.ones_like(h[:, 0]))
        h[:, 0] = 1.0  # the root always accepts (w_0 = 1)
        return p, q, w, h, m

    def _verify_batch(self, batch, target_logits, sampling, draft_probs, u) -> BatchVerifyResult:
        chain, length = first_child_chain(batch)
        bsz, l1 = chain.shape
        p, q, w, h, m = self._weights(chain, length, batch, target_logits, sampling, draft_probs)
        eta = u[:, 0, :l1].to(self.dtype)
        ok = eta < h  # [B, L+1]
        idx = torch.arange(l1, device=chain.device).unsqueeze(0).expand(bsz, l1)
        tau = torch.where(ok, idx, torch.zeros_like(idx)).max(dim=1).values  # deepest accepted
        ar = torch.arange(bsz, device=chain.device)
        at_leaf = tau == length
        dist = torch.where(at_leaf.unsqueeze(1), p[ar, tau], m[ar, tau])
        bonus = sample_inverse_cdf(dist, u[:, 0, batch.max_depth + 1])
        cols = torch.arange(1, max(l1, 2), device=chain.device).unsqueeze(0)
        acc = torch.where(cols <= tau.unsqueeze(1), chain[:, 1 : max(l1, 2)] - batch.root_index.unsqueeze(1), -1)
        if l1 == 1:
            acc = torch.full((bsz, 1), -1, dtype=torch.int64, device=chain.device)
        return BatchVerifyResult(accepted=acc, num_accepted=tau, bonus_tokens=bonus)

    def reference_tree(self, tree_nodes, batch, logits, sampling_b, q, u_b) -> VerifyResult:
        """Plain loop: walk the first-child chain, then test nodes leaf -> root."""
        root = tree_nodes[0]
        chain = [root]
        while int(batch.children[chain[-1], 0]) >= 0:
            chain.append(int(batch.children[chain[-1], 0]))
        big_l = len(chain) - 1
        ps = [target_probs(logits[n : n + 1], sampling_b.temperature, sampling_b.top_k, sampling_b.top_p, self.dtype)[0]
              for n in chain]
        qs = [q[n].to(self.dtype) for n in chain]
        w = [1.0]
        for i in range(1, big_l + 1):
            x = int(batch.tokens[chain[i]])
            w.append(min(1.0, w[-1] * float(ps[i - 1][x]) / max(float(qs[i - 1][x]), torch.finfo(self.dtype).tiny)))
        for i in range(big_l, -1, -1):
            if i == big_l:
                h, dist = w[i], ps[i]
            else:
                dist = (w[i] * ps[i] - qs[i]).clamp(min=0)
                dsum = float(dist.sum())
                h = dsum / (dsum + 1.0 - w[i]) if dsum > 0 else 0.0
            if i == 0 or float(u_b[0, i]) < h:
                y = int(sample_inverse_cdf(dist.unsqueeze(0), u_b[0, batch.max_depth + 1].reshape(1))[0])
                return VerifyResult([n - root for n in chain[1 : i + 1]], y)
        raise AssertionError("unreachable: the root always accepts")
