"""Traversal Verification: bottom-up, sequence-level verification of i.i.d. draft trees
(Weng et al. 2025, arXiv 2505.12398; arXiv 2602.16994 Sec. 3.2). On a single path it is Block
Verification (Sun et al. 2024, arXiv 2403.10444).

Scope: exact (lossless) verification of trees whose sibling subtrees are independent draws
from the draft model (unmerged i.i.d. / delayed trees; multiplicity 1). Nodes are visited in
post-order (children in priority order, each child's subtree before the next child, a node
after all its children): leaf first, root last.

State of a node c on the current root path: a weight alpha_c (sequence-level acceptance
weight) and a current target p_c (starts as the processed p(. | c)).

    enter child x of c:  alpha_x = min(1, alpha_c * p_c(x) / q_c(x))     (sequence-level ratio)
    exit node c (all children rejected):
        accept c with prob alpha_c  ->  emit path(root..c) + y ~ p_c      (stop)
        reject c: at its parent P (alpha = alpha_P, p = p_P, q = q_P):
            m       = max(0, alpha * p - q)                               (missing mass)
            D       = sum(m)
            alpha_P = D / (1 - alpha + D)
            p_P     = m / D

Why exact (the invariant, proved by induction over the subtree): for a node c with weight
alpha, P(subtree(c) is not rejected, and the emitted continuation completed by target
sampling equals z) = alpha * P_p(z | c). A leaf satisfies it by construction. For an inner
node, child x ~ q succeeds with joint mass min(q(x), alpha p(x)) * P_p(. | c, x); the missing
mass is m = (alpha p - q)_+, and the child fails with prob 1 - (alpha - D); conditioned on the
failure the remaining siblings (still i.i.d. q) must realise m / (1 - alpha + D), which is
the state (alpha_P, p_P) above. At the root alpha = 1, so alpha_P stays 1 and the root
always accepts: the output is exactly target-distributed. For a chain the acceptance
probabilities are Block Verification's h_i = D_i / (D_i + 1 - w_i) (Sun et al. 2024).

Uniforms: one row per post-order event e: u[:, e, 0] the accept test at an exit, u[:, e, 1]
the bonus sample.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_anisotropic.tree import TreeBatch
from vllm_anisotropic.verifiers.base import BatchVerifyResult, Verifier, VerifyResult
from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf, target_probs

__all__ = ["TraversalVerifier", "postorder_events", "ENTER", "EXIT"]

ENTER, EXIT = 0, 1


def postorder_events(batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-order event lists, -1 padded: (types [batch_size, E], nodes [batch_size, E]).

    Root r with children a (child c) and b: ENTER a, ENTER c, EXIT c, EXIT a, ENTER b, EXIT b,
    EXIT r. Every tree has 2 * (num_nodes - 1) + 1 events.
    """
    children = batch.children.cpu().numpy()
    offsets = batch.node_offsets.cpu().numpy()
    e_max = int(2 * (np.diff(offsets).max() - 1) + 1)
    types = np.full((batch.batch_size, e_max), -1, np.int64)
    nodes = np.full((batch.batch_size, e_max), -1, np.int64)
    for b in range(batch.batch_size):
        ev: list[tuple[int, int]] = []
        stack = [(int(offsets[b]), 0)]  # (node, next child slot)
        while stack:
            node, k = stack[-1]
            kids = children[node]
            if k < kids.shape[0] and kids[k] >= 0:
                stack[-1] = (node, k + 1)
                ev.append((ENTER, int(kids[k])))
                stack.append((int(kids[k]), 0))
            else:
                stack.pop()
                ev.append((EXIT, node))
        arr = np.asarray(ev, np.int64)
        types[b, : len(ev)] = arr[:, 0]
        nodes[b, : len(ev)] = arr[:, 1]
    dev = batch.tokens.device
    return torch.from_numpy(types).to(dev), torch.from_numpy(nodes).to(dev)


class TraversalVerifier(Verifier):
    name = "traversal"
    requires_draft_probs = True
    requires_unmerged = True

    def uniform_shape(self, batch: TreeBatch) -> tuple[int, int]:
        return int(2 * (batch.node_offsets.diff().max() - 1) + 1), 2

    def _verify_batch(self, batch, target_logits, sampling, draft_probs, u) -> BatchVerifyResult:
        dev = target_logits.device
        bsz, vocab = batch.batch_size, target_logits.shape[1]
        dmax = batch.max_depth
        types, nodes = postorder_events(batch)
        roots = batch.root_index
        ar = torch.arange(bsz, device=dev)
        # per-depth state of the current root path
        p_state = torch.zeros(bsz, dmax + 1, vocab, dtype=self.dtype, device=dev)  # [B, D+1, V]
        q_state = torch.zeros(bsz, dmax + 1, vocab, dtype=self.dtype, device=dev)  # [B, D+1, V]
        alpha = torch.zeros(bsz, dmax + 1, dtype=self.dtype, device=dev)  # [B, D+1]
        path = torch.full((bsz, dmax + 1), -1, dtype=torch.int64, device=dev)  # [B, D+1] global
        p_state[:, 0] = target_probs(target_logits[roots], sampling.temperature, sampling.top_k, sampling.top_p, self.dtype)
        q_state[:, 0] = draft_probs[roots].to(self.dtype)
        alpha[:, 0] = 1.0
        path[:, 0] = roots
        active = torch.ones(bsz, dtype=torch.bool, device=dev)
        num_acc = torch.zeros(bsz, dtype=torch.int64, device=dev)
        bonus = torch.zeros(bsz, dtype=torch.int64, device=dev)
        has_kids = batch.children[:, 0] >= 0  # [num_nodes]
        tiny = torch.finfo(self.dtype).tiny
        for e in range(types.shape[1]):
            t_e, n_e = types[:, e], nodes[:, e]
            # ---- ENTER child x of c: alpha_x = min(1, alpha_c p_c(x) / q_c(x))
            ent = (active & (t_e == ENTER)).nonzero().squeeze(1)
            if ent.numel():
                j = n_e[ent]
                d = batch.depths[j]
                x = batch.tokens[j]
                px = p_state[ent, d - 1, x]
                qx = q_state[ent, d - 1, x]
                alpha[ent, d] = (alpha[ent, d - 1] * px / qx.clamp(min=tiny)).clamp(max=1.0)
                p_state[ent, d] = target_probs(
                    target_logits[j], sampling.temperature[ent], sampling.top_k[ent], sampling.top_p[ent], self.dtype
                )
                kid = has_kids[j]
                if bool(kid.any()):
                    q_state[ent[kid], d[kid]] = draft_probs[j[kid]].to(self.dtype)
                path[ent, d] = j
            # ---- EXIT node c: accept with alpha_c, else hand the missing mass to the parent
            ext = (active & (t_e == EXIT)).nonzero().squeeze(1)
            if ext.numel():
                j = n_e[ext]
                d = batch.depths[j]
                acc = (u[ext, e, 0] < alpha[ext, d]) | (d == 0)  # the root (alpha 1) always accepts
                a_rows, a_d = ext[acc], d[acc]
                if a_rows.numel():
                    bonus[a_rows] = sample_inverse_cdf(p_state[a_rows, a_d], u[a_rows, e, 1])
                    num_acc[a_rows] = a_d
                    active[a_rows] = False
                r_rows, r_d = ext[~acc], d[~acc] - 1
                if r_rows.numel():
                    a = alpha[r_rows, r_d].unsqueeze(1)
                    m = (a * p_state[r_rows, r_d] - q_state[r_rows, r_d]).clamp(min=0)  # (alpha p - q)_+
                    dm = m.sum(dim=1, keepdim=True)
                    ok = dm > 0
                    alpha[r_rows, r_d] = torch.where(ok, dm / (1.0 - a + dm), torch.zeros_like(dm)).squeeze(1)
                    p_state[r_rows, r_d] = torch.where(ok, m / torch.where(ok, dm, torch.ones_like(dm)), p_state[r_rows, r_d])
            if not bool(active.any()):
                break
        # accepted path: path[:, 1 .. num_acc], converted to local indices
        dcols = torch.arange(1, dmax + 1, device=dev).unsqueeze(0)
        acc_nodes = torch.where(dcols <= num_acc.unsqueeze(1), path[:, 1:] - roots.unsqueeze(1), -1)
        if dmax == 0:
            acc_nodes = torch.full((bsz, 1), -1, dtype=torch.int64, device=dev)
        del ar
        return BatchVerifyResult(accepted=acc_nodes, num_accepted=num_acc, bonus_tokens=bonus)

    # ------------------------------------------------------------------ slow reference
    def reference_tree(self, tree_nodes, batch, logits, sampling_b, q, u_b) -> VerifyResult:
        """Plain recursive loop for one tree (global node ids in ``tree_nodes``)."""
        root = tree_nodes[0]
        kids = {int(n): [int(c) for c in batch.children[n].tolist() if c >= 0] for n in tree_nodes}
        tok = batch.tokens
        ev = [0]  # event counter (matches postorder_events)

        def p_of(n):
            return target_probs(logits[n : n + 1], sampling_b.temperature, sampling_b.top_k, sampling_b.top_p,
                                self.dtype)[0]

        state = {root: [1.0, p_of(root)]}

        def visit(c):  # returns accepted node (global) + bonus, or None when c is rejected
            for x in kids[c]:
                ev[0] += 1  # ENTER x
                a_c, p_c = state[c]
                qc = q[c].to(self.dtype)
                ratio = float(p_c[int(tok[x])]) / max(float(qc[int(tok[x])]), torch.finfo(self.dtype).tiny)
                state[x] = [min(1.0, a_c * ratio), p_of(x)]
                out = visit(x)
                if out is not None:
                    return out
                # child x rejected: missing mass m = (alpha p - q)_+ moves into c's state
                m = (a_c * p_c - qc).clamp(min=0)
                dm = float(m.sum())
                state[c] = [dm / (1.0 - a_c + dm), m / dm] if dm > 0 else [0.0, p_c]
            e = ev[0]
            ev[0] += 1  # EXIT c
            a_c, p_c = state[c]
            if c == root or float(u_b[e, 0]) < a_c:
                y = int(sample_inverse_cdf(p_c.unsqueeze(0), u_b[e, 1].reshape(1))[0])
                return c, y
            return None

        node, y = visit(root)
        path = []
        while node != root:
            path.append(node - root)
            node = int(batch.parents[node])
        return VerifyResult(path[::-1], y)
