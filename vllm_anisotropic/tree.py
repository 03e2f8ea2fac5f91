"""The one draft-tree type: every proposer emits it, every verifier and allocator consumes it.

Scope: the data structure (``DraftTree``), its derived index arrays (depths, positions,
ancestor masks, first-child / next-sibling links, priority-ordered child tables) and the
packing of many trees into one flat batch (``TreeBatch``). No sampling, no vLLM.

Sources: draft trees as in SpecInfer (Miao et al. 2024, arXiv 2305.09781) and the GOOSE spine
tree (arXiv 2604.02047, Sec. 4 and Algorithm 3: nodes tagged by source, spine before branch); the
multiset child lists of i.i.d. multi-path trees follow Definition 3.1 of arXiv 2602.16994
(Thomas et al., "Dynamic Delayed Tree Expansion").

Terms
-----
node 0, the root
    The last accepted token (the "anchor" in GOOSE). Not a draft: it is never verified.
    ``parents[0] == -1``, ``sources[0] == NodeSource.ROOT``, ``values[0] == 1``.
parent-before-child order
    ``parents[i] < i`` for every ``i > 0``. The proposers put nodes in *value order* (most
    valuable first, parents first), so ``truncate(n)`` keeps the n most valuable nodes and is
    always a valid tree.
value
    Estimated probability that the node's whole root-to-node path is accepted.
draft distribution (``draft_probs``)
    Only for trees sampled from a draft model. Convention (same indexing as the target
    logits): **row i is q(. | path to node i), the distribution the children of node i were
    sampled from.** Rows of leaves are unused. Deterministic trees (GOOSE, top-k) have none.
multiplicity
    Number of i.i.d. draft paths through a node (Definition 3.1 of arXiv 2602.16994: the child list
    of a node is a multiset). 1 everywhere for unmerged trees; a trie that merged K i.i.d.
    paths stores the counts here, so the child multiset of node c is every child j repeated
    ``multiplicity[j]`` times.
depth / position
    ``depth[0] == 0``; a node's position is ``prompt_len + depth``, where ``prompt_len`` is
    the number of tokens before the root (so the root sits at position ``prompt_len`` and
    every child one position after its parent).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["NodeSource", "DraftTree", "FlatTrees", "TreeBatch", "pack_trees", "SOURCE_PRIORITY", "chain_length"]


class NodeSource(enum.IntEnum):
    """Where a node's token came from (GOOSE arXiv 2604.02047 Sec. 4: PLD spine vs TR branch)."""

    ROOT = 0  # the last accepted token, not a draft
    SPINE = 1  # context match (prompt-lookup n-gram copy): the deep, reliable chain
    BRANCH = 2  # adjacency-table / token-recycling alternative forking from a node
    DRAFT = 3  # sampled from a draft model q (carries draft_probs)


# Rank used to order siblings for the greedy walk and the deterministic sampler
# (GOOSE Algorithm 3: spine children are checked before branch children). Lower first;
# equal ranks keep node-index (value) order.
SOURCE_PRIORITY: dict[NodeSource, int] = {
    NodeSource.ROOT: 0,
    NodeSource.SPINE: 0,
    NodeSource.BRANCH: 1,
    NodeSource.DRAFT: 1,
}
# [len(NodeSource)] the rank of each source code in the child priority order (SOURCE_PRIORITY)
PRIORITY_BY_CODE = np.array([SOURCE_PRIORITY[NodeSource(c)] for c in range(len(NodeSource))])


def chain_length(draft_parents) -> int:
    """Largest c with ``draft_parents[:c] == [0..c-1]``, given the parents of draft nodes 1..n
    (local indices, 0: the root): nodes 1..c form a chain below the root. ``[0, 1, 0, 3] -> 2``."""
    draft_parents = np.asarray(draft_parents)
    off = np.nonzero(draft_parents != np.arange(len(draft_parents)))[0]
    return int(off[0]) if len(off) else len(draft_parents)


def _as_int64(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.int64))


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree in parent-before-child order. Node 0 is the root (last accepted token).

    Example (a spine of two tokens with one branch at the root)::

        tokens  = [5, 17, 9, 23]        # node 0 = root token 5
        parents = [-1, 0, 1, 0]         # 17 -> 9 is the spine, 23 a branch
        sources = [ROOT, SPINE, SPINE, BRANCH]
        depths  = [0, 1, 2, 1]
    """

    # [num_nodes] int64; tokens[0] is the root (last accepted) token
    tokens: np.ndarray
    # [num_nodes] int64; parents[0] == -1 and parents[i] < i
    parents: np.ndarray
    # [num_nodes] int8 NodeSource codes; sources[0] == ROOT
    sources: np.ndarray = None  # type: ignore[assignment]
    # [num_nodes] float64; estimated probability that the path root->i is accepted
    values: np.ndarray = None  # type: ignore[assignment]
    # [num_nodes, vocab_size] or None; row i = q(. | path to i), the law of node i's children
    draft_probs: torch.Tensor | None = None
    # [num_nodes] int64 >= 1; i.i.d. draft paths through the node (child multiset counts)
    multiplicity: np.ndarray = None  # type: ignore[assignment]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens = _as_int64(self.tokens)
        parents = _as_int64(self.parents)
        n = tokens.shape[0]
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if self.sources is None:
            src = np.full(n, NodeSource.DRAFT if self.draft_probs is not None else NodeSource.BRANCH, np.int8)
            if n:
                src[0] = NodeSource.ROOT
        else:
            src = np.ascontiguousarray(np.asarray(self.sources, dtype=np.int8))
        object.__setattr__(self, "sources", src)
        vals = np.ones(n) if self.values is None else np.asarray(self.values, dtype=np.float64)
        object.__setattr__(self, "values", np.ascontiguousarray(vals))
        mult = np.ones(n, np.int64) if self.multiplicity is None else _as_int64(self.multiplicity)
        object.__setattr__(self, "multiplicity", mult)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError unless every invariant of the type holds."""
        n = self.num_nodes
        if n < 1:
            raise ValueError("a DraftTree has at least the root node")
        for name in ("parents", "sources", "values", "multiplicity"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} must have shape ({n},), got {getattr(self, name).shape}")
        if self.tokens.ndim != 1:
            raise ValueError("tokens must be 1-D")
        if self.parents[0] != -1:
            raise ValueError("parents[0] must be -1 (node 0 is the root)")
        idx = np.arange(n)
        if n > 1 and not np.all((self.parents[1:] >= 0) & (self.parents[1:] < idx[1:])):
            raise ValueError("parents must satisfy 0 <= parents[i] < i for i > 0")
        if self.sources[0] != NodeSource.ROOT or np.any(self.sources[1:] == NodeSource.ROOT):
            raise ValueError("exactly node 0 has source ROOT")
        if np.any((self.sources < 0) | (self.sources >= len(NodeSource))):
            raise ValueError("unknown source code")
        if np.any(self.tokens < 0):
            raise ValueError("tokens must be non-negative")
        if np.any(self.multiplicity < 1):
            raise ValueError("multiplicity must be >= 1")
        if self.draft_probs is not None:
            if self.draft_probs.ndim != 2 or self.draft_probs.shape[0] != n:
                raise ValueError(f"draft_probs must be [num_nodes={n}, vocab_size]")
            if int(self.tokens.max()) >= self.draft_probs.shape[1]:
                raise ValueError("token id out of draft vocabulary")

    # ------------------------------------------------------------------ basic
    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def has_draft_probs(self) -> bool:
        return self.draft_probs is not None

    def _memo(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def depths(self) -> np.ndarray:
        """[num_nodes] int64; depths[0] == 0, depths[i] = depths[parents[i]] + 1."""

        def build():
            d = np.zeros(self.num_nodes, np.int64)
            for i in range(1, self.num_nodes):  # parent-before-child: one pass suffices
                d[i] = d[self.parents[i]] + 1
            return d

        return self._memo("depths", build)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def positions(self, prompt_len: int) -> np.ndarray:
        """[num_nodes] int64 position ids: ``prompt_len + depth``.

        ``depths [0,1,1,2], prompt_len 7 -> positions [7,8,8,9]``.
        """
        return self.depths + int(prompt_len)

    @property
    def num_children(self) -> np.ndarray:
        """[num_nodes] int64 number of child nodes (not counting multiplicity)."""
        return self._memo("nchild", lambda: np.bincount(self.parents[1:], minlength=self.num_nodes).astype(np.int64))

    @property
    def is_leaf(self) -> np.ndarray:
        return self.num_children == 0

    @property
    def first_child(self) -> np.ndarray:
        """[num_nodes] int64; first child in *priority order* (see ``children``), -1 if leaf."""
        return self._memo("links", self._links)[0]

    @property
    def next_sibling(self) -> np.ndarray:
        """[num_nodes] int64; next sibling in priority order, -1 if last. Root: -1.

        ``parents [-1,0,0,1] (all same source) -> first_child [1,3,-1,-1],
        next_sibling [-1,2,-1,-1]``.
        """
        return self._memo("links", self._links)[1]

    def _links(self):
        n = self.num_nodes
        first = np.full(n, -1, np.int64)
        nxt = np.full(n, -1, np.int64)
        for c, kids in enumerate(self.children_lists()):
            if kids:
                first[c] = kids[0]
                for a, b in zip(kids[:-1], kids[1:]):
                    nxt[a] = b
        return first, nxt

    def children_lists(self) -> list[list[int]]:
        """Child node indices of every node, in priority order.

        Priority order (GOOSE Algorithm 3): SPINE children before BRANCH/DRAFT children;
        within equal priority, ascending node index (= value order).
        """

        def build():
            kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
            rank = PRIORITY_BY_CODE[self.sources]
            order = np.lexsort((np.arange(self.num_nodes), rank))  # by rank, then index
            for j in order:
                if j > 0:
                    kids[self.parents[j]].append(int(j))
            return kids

        return self._memo("kids", build)

    def chain_prefix(self) -> int:
        """Largest c with ``parents[1..c] == [0..c-1]``: nodes 1..c form a chain below the root.

        ``parents [-1, 0, 1, 0, 2] -> 2``; a pure chain of n nodes -> n (``FlatTrees.chain_prefix``
        computes it for a whole batch)."""
        return chain_length(self.parents[1:])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first descendant to ``node`` (root excluded)."""
        path = []
        while node > 0:
            path.append(int(node))
            node = int(self.parents[node])
        return path[::-1]

    # ------------------------------------------------------------------ masks
    @property
    def ancestor_mask(self) -> np.ndarray:
        """[num_nodes, num_nodes] bool; ``mask[i, j]`` iff j is i or an ancestor of i.

        This is the tree attention mask: node i attends to node j iff ``mask[i, j]``.
        ``parents [-1,0,0,1] -> rows [1000],[1100],[1010],[1101]``.
        """

        def build():
            n = self.num_nodes
            m = np.zeros((n, n), bool)
            for i in range(n):
                m[i, i] = True
                if i > 0:
                    m[i] |= m[self.parents[i]]
            return m

        return self._memo("amask", build)

    @property
    def ancestor_bits(self) -> np.ndarray:
        """[num_nodes] int64 bit-packed ancestor mask; bit j of entry i == ``ancestor_mask[i, j]``.

        Only for trees of at most 64 nodes (bit 63 is the sign bit of int64; read it with
        ``(bits >> j) & 1``). ``parents [-1,0,0,1] -> [0b1, 0b11, 0b101, 0b1011] = [1,3,5,11]``.
        """
        if self.num_nodes > 64:
            raise ValueError(f"ancestor_bits needs <= 64 nodes, tree has {self.num_nodes}")

        def build():
            bits = np.zeros(self.num_nodes, np.uint64)
            for i in range(self.num_nodes):
                own = np.uint64(1) << np.uint64(i)
                bits[i] = own | (bits[self.parents[i]] if i > 0 else np.uint64(0))
            return bits.view(np.int64)

        return self._memo("abits", build)

    # ------------------------------------------------------------------ edits
    def truncate(self, n: int) -> "DraftTree":
        """The first ``n`` nodes (n >= 1). Always a valid tree (parents come first)."""
        if n < 1:
            raise ValueError("truncate keeps at least the root")
        n = min(int(n), self.num_nodes)
        if n == self.num_nodes:
            return self
        # A prefix of a valid tree is valid (parents come first): no re-validation, and the
        # prefix-closed caches (depths, ancestor masks) are sliced rather than rebuilt.
        out = DraftTree._unchecked(self.tokens[:n], self.parents[:n], self.sources[:n], self.values[:n],
                                   None if self.draft_probs is None else self.draft_probs[:n], self.multiplicity[:n])
        for key in ("depths", "abits"):
            if key in self._cache:
                out._cache[key] = self._cache[key][:n]
        if "amask" in self._cache:
            out._cache["amask"] = self._cache["amask"][:n, :n]
        return out

    def reordered(self, order) -> "DraftTree":
        """The same tree with its nodes listed in ``order`` (a permutation of ``0..n-1`` that keeps
        the root first and every parent before its children; raises otherwise).

        ``parents [-1, 0, 0, 2]``, order ``[0, 2, 3, 1]`` -> ``parents [-1, 0, 1, 0]``.
        """
        order = _as_int64(order)
        n = self.num_nodes
        if order.shape != (n,) or order[0] != 0 or not np.array_equal(np.sort(order), np.arange(n)):
            raise ValueError(f"order must be a permutation of 0..{n - 1} starting with the root")
        inverse = np.empty(n, np.int64)
        inverse[order] = np.arange(n)
        parents = self.parents[order]
        return DraftTree(
            tokens=self.tokens[order],
            parents=np.where(parents >= 0, inverse[np.maximum(parents, 0)], -1),
            sources=self.sources[order],
            values=self.values[order],
            draft_probs=None if self.draft_probs is None else self.draft_probs[torch.from_numpy(order)],
            multiplicity=self.multiplicity[order],
        )

    @staticmethod
    def _unchecked(tokens, parents, sources, values, draft_probs, multiplicity) -> "DraftTree":
        """A tree from arrays already in their final dtypes whose invariants the caller
        guarantees (a prefix of a valid tree, a chain built as one): no checks, no copies."""
        out = object.__new__(DraftTree)
        for name, value in (("tokens", tokens), ("parents", parents), ("sources", sources), ("values", values),
                            ("draft_probs", draft_probs), ("multiplicity", multiplicity), ("_cache", {})):
            object.__setattr__(out, name, value)
        return out

    @staticmethod
    def spine(root_token: int, spine, values: np.ndarray) -> "DraftTree":
        """The chain root -> spine[0] -> spine[1] -> ..., SPINE nodes with ``values``
        ([1 + len(spine)] float64), built without the checks (valid by construction: the
        engine's chain steps build one per request and step). Token ids must be >= 0."""
        m = len(spine)
        tokens = np.empty(m + 1, np.int64)
        tokens[0] = root_token
        tokens[1:] = spine
        sources = np.full(m + 1, NodeSource.SPINE, np.int8)
        sources[0] = NodeSource.ROOT
        return DraftTree._unchecked(tokens, np.arange(-1, m, dtype=np.int64), sources,
                                    np.ascontiguousarray(values, np.float64), None, np.ones(m + 1, np.int64))

    @staticmethod
    def chain(tokens, root_token: int = 0, source: NodeSource = NodeSource.SPINE, draft_probs=None) -> "DraftTree":
        """A linear chain root -> tokens[0] -> tokens[1] -> ... ."""
        t = [int(root_token)] + [int(x) for x in tokens]
        n = len(t)
        src = [NodeSource.ROOT] + [source] * (n - 1)
        return DraftTree(tokens=t, parents=list(range(-1, n - 1)), sources=src, draft_probs=draft_probs)

    @staticmethod
    def from_paths(paths, root_token: int = 0, merge: bool = False, source: NodeSource = NodeSource.DRAFT) -> "DraftTree":
        """Build a tree from token paths (each a sequence starting below the root).

        ``merge=False`` keeps every path separate (duplicate sibling tokens allowed: each
        path is an independent draw); ``merge=True`` builds a trie and counts the paths
        through each node in ``multiplicity``. Either form is a valid input to every
        OT verifier; Traversal/Block need unmerged trees.
        Example: paths [[1,2],[1,3]] merged -> tokens [r,1,2,3], parents [-1,0,1,1],
        multiplicity [1,2,1,1]; unmerged -> tokens [r,1,2,1,3], parents [-1,0,1,0,3].
        """
        tokens, parents, mult = [int(root_token)], [-1], [1]
        index: dict[tuple, int] = {(): 0}
        for path in paths:
            prefix: tuple = ()
            parent = 0
            for k, tok in enumerate(path):
                key = prefix + (int(tok),) if merge else (id(path), k)
                if merge and key in index:
                    node = index[key]
                    mult[node] += 1
                else:
                    node = len(tokens)
                    tokens.append(int(tok))
                    parents.append(parent)
                    mult.append(1)
                    index[key] = node
                prefix = prefix + (int(tok),)
                parent = node
        src = [NodeSource.ROOT] + [source] * (len(tokens) - 1)
        return DraftTree(tokens=tokens, parents=parents, sources=src, multiplicity=mult)

    def with_draft_probs(self, draft_probs: torch.Tensor | None) -> "DraftTree":
        return DraftTree(self.tokens, self.parents, self.sources, self.values, draft_probs, self.multiplicity)

@dataclass(frozen=True, eq=False)
class FlatTrees:
    """Many trees as flat host arrays: the form the engine's per-step path passes between its
    stages (proposer -> allocator -> positions and attention plan -> walk -> harvest and metrics).

    Tree k holds nodes ``offsets[k] .. offsets[k + 1] - 1``, root first, each tree in
    parent-before-child (value) order as a ``DraftTree``; ``parents`` are *local* (index within
    the tree, -1 for the root), ``depths`` are stored, not recomputed. Worked example, two trees
    (root 5 with children 6, 7; root 9 alone)::

        offsets  = [0, 3, 4]
        tokens   = [5, 6, 7, 9]
        parents  = [-1, 0, 0, -1]
        depths   = [0, 1, 1, 0]
        sizes()  = [3, 1];  tree_index() = [0, 0, 0, 1];  global_parents() = [-1, 0, 0, -1]

    ``multiplicity`` and ``draft_probs`` (one entry per tree: its ``[nodes, vocab_size]`` rows or
    None) are set only for draft-model trees. ``tree(k)`` gives tree k as a ``DraftTree`` (views,
    no copy).
    """

    # [num_trees + 1] int64 cumulative node counts
    offsets: np.ndarray
    # [num_nodes] int64
    tokens: np.ndarray
    # [num_nodes] int64 local parent index, -1 for roots
    parents: np.ndarray
    # [num_nodes] int8 NodeSource codes
    sources: np.ndarray
    # [num_nodes] float64
    values: np.ndarray
    # [num_nodes] int64
    depths: np.ndarray
    # [num_nodes] int64 or None (all 1)
    multiplicity: np.ndarray | None = None
    # per tree: [its nodes, vocab_size] or None; the whole list None when no tree has them
    draft_probs: list | None = None

    # ------------------------------------------------------------------ shape
    @property
    def num_trees(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def sizes(self) -> np.ndarray:
        """[num_trees] int64 nodes per tree (root included); computed once (the arrays are
        never edited in place)."""
        sizes = self.__dict__.get("_sizes")
        if sizes is None:
            sizes = self.__dict__["_sizes"] = np.diff(self.offsets)
        return sizes

    def tree_index(self) -> np.ndarray:
        """[num_nodes] int64 the tree each node belongs to."""
        return np.repeat(np.arange(self.num_trees), self.sizes())

    def global_parents(self) -> np.ndarray:
        """[num_nodes] int64 parent as a flat index, -1 for roots."""
        base = np.repeat(self.offsets[:-1], self.sizes())
        return np.where(self.parents >= 0, self.parents + base, -1)

    # ------------------------------------------------------------------ conversions
    @staticmethod
    def empty() -> "FlatTrees":
        z = np.zeros(0, np.int64)
        return FlatTrees(np.zeros(1, np.int64), z, z, np.zeros(0, np.int8), np.zeros(0), z)

    @staticmethod
    def from_trees(trees) -> "FlatTrees":
        """Pack ``DraftTree``s (no copy of their per-node logic: depths are the trees' own)."""
        if not trees:
            return FlatTrees.empty()
        sizes = np.fromiter((t.num_nodes for t in trees), np.int64, len(trees))
        offsets = np.zeros(len(trees) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        drafts = [t.draft_probs for t in trees]
        mult = np.concatenate([t.multiplicity for t in trees])
        return FlatTrees(
            offsets=offsets,
            tokens=np.concatenate([t.tokens for t in trees]),
            parents=np.concatenate([t.parents for t in trees]),
            sources=np.concatenate([t.sources for t in trees]),
            values=np.concatenate([t.values for t in trees]),
            depths=np.concatenate([t.depths for t in trees]),
            multiplicity=None if np.all(mult == 1) else mult,
            draft_probs=drafts if any(q is not None for q in drafts) else None,
        )

    @staticmethod
    def concat(parts: list["FlatTrees"]) -> "FlatTrees":
        """The trees of ``parts``, in order, as one batch."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return FlatTrees.empty()
        sizes = np.concatenate([p.sizes() for p in parts])
        offsets = np.zeros(sizes.shape[0] + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        mult = None
        if any(p.multiplicity is not None for p in parts):
            mult = np.concatenate([np.ones(p.num_nodes, np.int64) if p.multiplicity is None else p.multiplicity
                                   for p in parts])
        q = None
        if any(p.draft_probs is not None for p in parts):
            q = [x for p in parts for x in (p.draft_probs if p.draft_probs is not None else [None] * p.num_trees)]
        return FlatTrees(offsets, *(np.concatenate([getattr(p, f) for p in parts])
                                    for f in ("tokens", "parents", "sources", "values", "depths")), mult, q)

    def tree(self, k: int) -> DraftTree:
        """Tree k as a ``DraftTree`` over views of these arrays (its depths cached)."""
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        mult = np.ones(b - a, np.int64) if self.multiplicity is None else self.multiplicity[a:b]
        q = None if self.draft_probs is None else self.draft_probs[k]
        out = DraftTree._unchecked(self.tokens[a:b], self.parents[a:b], self.sources[a:b], self.values[a:b], q, mult)
        out._cache["depths"] = self.depths[a:b]
        return out

    def trees(self) -> list[DraftTree]:
        return [self.tree(k) for k in range(self.num_trees)]

    # ------------------------------------------------------------------ edits (vectorised)
    def _gather(self, nodes: np.ndarray, sizes: np.ndarray, draft_probs=None) -> "FlatTrees":
        offsets = np.zeros(sizes.shape[0] + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return FlatTrees(
            offsets=offsets,
            tokens=self.tokens[nodes],
            parents=self.parents[nodes],
            sources=self.sources[nodes],
            values=self.values[nodes],
            depths=self.depths[nodes],
            multiplicity=None if self.multiplicity is None else self.multiplicity[nodes],
            draft_probs=draft_probs,
        )

    def select(self, index) -> "FlatTrees":
        """Trees ``index`` (any order, repeats allowed) as a batch (``self`` for every tree in order;
        trees are never edited in place).
        ``sizes [3, 1, 2]``, index ``[2, 0]`` -> trees with 2 and 3 nodes."""
        index = np.asarray(index, np.int64)
        if index.shape[0] == self.num_trees and np.array_equal(index, np.arange(self.num_trees)):
            return self  # every tree, in order (the common step): nothing to gather
        sizes = self.sizes()[index]
        starts = self.offsets[:-1][index]
        nodes = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
        q = None if self.draft_probs is None else [self.draft_probs[k] for k in index.tolist()]
        return self._gather(nodes, sizes, q)

    def prefix(self, keep) -> "FlatTrees":
        """The first ``keep[k]`` nodes of tree k (``1 <= keep[k]``; more than the tree has: all):
        ``DraftTree.truncate`` of every tree at once, a valid subtree by the node order."""
        keep = np.minimum(np.asarray(keep, np.int64), self.sizes())
        if keep.shape != (self.num_trees,) or np.any(keep < 1):
            raise ValueError(f"keep must hold one count >= 1 per tree ({self.num_trees}), got {keep}")
        if np.array_equal(keep, self.sizes()):
            return self  # every node kept
        local = np.arange(self.num_nodes) - np.repeat(self.offsets[:-1], self.sizes())
        nodes = np.flatnonzero(local < np.repeat(keep, self.sizes()))
        q = None if self.draft_probs is None else [
            None if p is None else p[:n] for p, n in zip(self.draft_probs, keep.tolist())]
        return self._gather(nodes, keep, q)

    def permuted(self, order) -> "FlatTrees":
        """The same trees with their nodes listed in ``order``: a permutation of the flat nodes
        that keeps every tree's nodes in its own range, its root first and every parent before
        its children (``DraftTree.reordered`` of every tree at once).
        ``parents [-1, 0, 0, 2 | -1]``, order ``[0, 2, 3, 1, 4]`` -> ``[-1, 0, 1, 0 | -1]``."""
        order = np.asarray(order, np.int64)
        n = self.num_nodes
        inverse = np.empty(n, np.int64)
        inverse[order] = np.arange(n)
        gp = self.global_parents()[order]
        base = np.repeat(self.offsets[:-1], self.sizes())
        parents = np.where(gp >= 0, inverse[np.maximum(gp, 0)] - base, -1)
        q = None
        if self.draft_probs is not None:
            local = order - base
            q = [None if p is None else p[torch.from_numpy(local[a:b])]
                 for p, a, b in zip(self.draft_probs, self.offsets[:-1].tolist(), self.offsets[1:].tolist())]
        return FlatTrees(self.offsets, self.tokens[order], parents, self.sources[order], self.values[order],
                         self.depths[order], None if self.multiplicity is None else self.multiplicity[order], q)

    def path_mask(self, accepted: np.ndarray, num_accepted: np.ndarray) -> np.ndarray:
        """``[num_nodes]`` bool: the node is on its tree's accepted path, given ``accepted``
        ``[num_trees, D]`` local node indices (the first ``num_accepted[t]`` of row t count).
        offsets ``[0, 3, 5]``, accepted ``[[1, 2], [1, -1]]``, counts ``[2, 1]`` -> nodes 1, 2, 4."""
        on_path = np.zeros(self.num_nodes, bool)
        if accepted.size:
            valid = np.arange(accepted.shape[1])[None, :] < num_accepted[:, None]
            on_path[(self.offsets[:-1, None] + accepted)[valid]] = True
        return on_path

    def chain_prefix(self) -> np.ndarray:
        """[num_trees] int64 c_k: nodes 1..c_k of tree k form a chain below its root
        (``parents[1..c] == [0..c-1]``). ``parents [-1, 0, 1, 0, 2 | -1, 0]`` -> ``[2, 1]``.
        Computed once (or given by whoever built the trees and knew it: ``allocator.rank_flat``)."""
        chains = self.__dict__.get("_chain_lens")
        if chains is None:
            chains = self.__dict__["_chain_lens"] = self._chain_prefix()
        return chains

    def _chain_prefix(self) -> np.ndarray:
        local = np.arange(self.num_nodes) - np.repeat(self.offsets[:-1], self.sizes())
        off = (local > 0) & (self.parents != local - 1)
        # first node off the chain per tree (its local index), or the tree's size
        first = np.where(off, local, np.iinfo(np.int64).max)
        sizes = self.sizes()
        out = sizes.copy()
        nonempty = sizes > 0
        if self.num_nodes:
            out[nonempty] = np.minimum(np.minimum.reduceat(first, self.offsets[:-1][nonempty]), sizes[nonempty])
        return np.maximum(out - 1, 0)

    def ancestor_bits(self) -> np.ndarray:
        """[num_nodes] uint64 bit-packed ancestor masks, local bits (bit j of node i: j is i or
        an ancestor of i); every tree must have <= 64 nodes. One pass per depth level.
        ``parents [-1, 0, 0, 1]`` -> ``[0b1, 0b11, 0b101, 0b1011]``."""
        if self.num_trees and int(self.sizes().max()) > 64:
            raise ValueError("ancestor_bits needs <= 64 nodes per tree")
        local = (np.arange(self.num_nodes) - np.repeat(self.offsets[:-1], self.sizes())).astype(np.uint64)
        bits = np.left_shift(np.uint64(1), local)
        gp = self.global_parents()
        for d in range(1, int(self.depths.max(initial=0)) + 1):
            lvl = np.flatnonzero(self.depths == d)
            bits[lvl] |= bits[gp[lvl]]
        return bits

    def to_batch(self, device="cpu", prompt_lens=None) -> "TreeBatch":
        """The verifiers' ``TreeBatch`` of these trees, built with array operations (the same
        batch as ``pack_trees(self.trees())``)."""
        n, r = self.num_nodes, self.num_trees
        if r == 0:
            raise ValueError("to_batch needs at least one tree")
        sizes = self.sizes()
        gp = self.global_parents()
        mult = np.ones(n, np.int64) if self.multiplicity is None else self.multiplicity
        # children of every node in priority order (rank, then index), -1 padded
        kids = np.flatnonzero(gp >= 0)
        order = kids[np.lexsort((kids, PRIORITY_BY_CODE[self.sources[kids]], gp[kids]))]
        counts = np.bincount(gp[order], minlength=n) if order.size else np.zeros(n, np.int64)
        group_start = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=group_start[1:])
        rank_in_group = np.arange(order.size) - group_start[gp[order]]
        children = np.full((n, max(int(counts.max(initial=0)), 1)), -1, np.int64)
        children[gp[order], rank_in_group] = order
        # child multiset: each child repeated by its multiplicity, in the same order
        reps = mult[order]
        slot_counts = np.bincount(gp[order], weights=reps, minlength=n).astype(np.int64) if order.size else counts
        slot_start = np.zeros(n + 1, np.int64)
        np.cumsum(slot_counts, out=slot_start[1:])
        rep_parent = np.repeat(gp[order], reps)
        slots = np.full((n, max(int(slot_counts.max(initial=0)), 1)), -1, np.int64)
        slots[rep_parent, np.arange(rep_parent.size) - slot_start[rep_parent]] = np.repeat(order, reps)
        plen = np.zeros(r, np.int64) if prompt_lens is None else np.asarray(prompt_lens, np.int64)
        bits = self.ancestor_bits().view(np.int64) if int(sizes.max()) <= 64 else None
        t64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(device)  # noqa: E731
        return TreeBatch(
            node_offsets=t64(self.offsets),
            tokens=t64(self.tokens),
            parents=t64(gp),
            local_parents=t64(self.parents),
            depths=t64(self.depths),
            positions=t64(self.depths + np.repeat(plen, sizes)),
            tree_index=t64(self.tree_index()),
            root_index=t64(self.offsets[:-1]),
            sources=t64(self.sources),
            values=torch.from_numpy(np.ascontiguousarray(self.values, np.float64)).to(device),
            children=t64(children),
            slots=t64(slots),
            ancestor_bits=None if bits is None else t64(bits),
            max_depth=int(self.depths.max()),
            unmerged=bool(np.all(mult == 1)),
        )


@dataclass(frozen=True)
class TreeBatch:
    """Many trees packed into flat arrays (torch, on one device) with cumulative offsets.

    Worked example: two trees with 3 and 2 nodes, prompt lengths 7 and 4::

        tree 0: parents [-1,0,0], depths [0,1,1]    tree 1: parents [-1,0], depths [0,1]
        node_offsets  = [0, 3, 5]                   # cu_num_nodes, tree b = [o[b], o[b+1])
        parents       = [-1, 0, 0, -1, 3]           # *global* flat indices, root: -1
        local_parents = [-1, 0, 0, -1, 0]
        depths        = [0, 1, 1, 0, 1]
        positions     = [7, 8, 8, 4, 5]             # prompt_len[b] + depth
        tree_index    = [0, 0, 0, 1, 1]
        root_index    = [0, 3]

    ``children[g, :]`` lists the global child indices of flat node g in priority order
    (-1 padded); ``slots[g, :]`` is the child *multiset*: each child repeated by its
    multiplicity (-1 padded). ``ancestor_bits`` is set when every tree has <= 64 nodes.
    """

    # [batch_size + 1] int64 cumulative node counts
    node_offsets: torch.Tensor
    # [num_nodes] int64 token ids
    tokens: torch.Tensor
    # [num_nodes] int64 global parent index, -1 for roots
    parents: torch.Tensor
    # [num_nodes] int64 local parent index, -1 for roots
    local_parents: torch.Tensor
    # [num_nodes] int64
    depths: torch.Tensor
    # [num_nodes] int64 (prompt_len + depth); zeros-based if no prompt lengths were given
    positions: torch.Tensor
    # [num_nodes] int64 which tree each node belongs to
    tree_index: torch.Tensor
    # [batch_size] int64 global index of each root
    root_index: torch.Tensor
    # [num_nodes] int8 NodeSource codes
    sources: torch.Tensor
    # [num_nodes] float64
    values: torch.Tensor
    # [num_nodes, max_children] int64 global child indices, priority order, -1 padded
    children: torch.Tensor
    # [num_nodes, max_slots] int64 child multiset (children repeated by multiplicity), -1 pad
    slots: torch.Tensor
    # [num_nodes] int64 bit-packed ancestor masks (local bits), or None if a tree has > 64 nodes
    ancestor_bits: torch.Tensor | None
    # max depth over the batch
    max_depth: int
    # True iff every multiplicity is 1 (no merged i.i.d. paths)
    unmerged: bool

    @property
    def batch_size(self) -> int:
        return int(self.root_index.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def repeat(self, n: int) -> "TreeBatch":
        """The batch tiled n times (trees b, then b again ...): [t0, t1, t0, t1, ...].

        Global indices are shifted per copy: ``parents`` [-1,0,-1,2] (2 trees, 4 nodes) repeated
        twice -> [-1,0,-1,2,-1,4,-1,6]. Used to run one tree many times (Monte Carlo, benches).
        """
        total = self.num_nodes
        shift = (torch.arange(n, device=self.tokens.device) * total).repeat_interleave(total)

        def glob(x):  # tile a global-index tensor, keeping -1 padding
            t = x.repeat(n, *([1] * (x.ndim - 1)))
            s = shift.view(-1, *([1] * (x.ndim - 1)))
            return torch.where(t >= 0, t + s, t)

        offs = self.node_offsets[1:].repeat(n) + (torch.arange(n, device=shift.device) * total).repeat_interleave(self.batch_size)
        return TreeBatch(
            node_offsets=torch.cat([self.node_offsets[:1], offs]),
            tokens=self.tokens.repeat(n),
            parents=glob(self.parents),
            local_parents=self.local_parents.repeat(n),
            depths=self.depths.repeat(n),
            positions=self.positions.repeat(n),
            tree_index=self.tree_index.repeat(n) + torch.arange(n, device=shift.device).repeat_interleave(total) * self.batch_size,
            root_index=self.root_index.repeat(n) + torch.arange(n, device=shift.device).repeat_interleave(self.batch_size) * total,
            sources=self.sources.repeat(n),
            values=self.values.repeat(n),
            children=glob(self.children),
            slots=glob(self.slots),
            ancestor_bits=None if self.ancestor_bits is None else self.ancestor_bits.repeat(n),
            max_depth=self.max_depth,
            unmerged=self.unmerged,
        )

    def to(self, device) -> "TreeBatch":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TreeBatch(**kw)


def pack_trees(trees: list[DraftTree], prompt_lens=None, device="cpu") -> TreeBatch:
    """Pack trees into one ``TreeBatch`` (see its docstring for the worked example)."""
    if not trees:
        raise ValueError("pack_trees needs at least one tree")
    counts = np.array([t.num_nodes for t in trees], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    total = int(offsets[-1])
    base = np.repeat(offsets[:-1], counts)
    local_parents = np.concatenate([t.parents for t in trees])
    parents = np.where(local_parents >= 0, local_parents + base, -1)
    depths = np.concatenate([t.depths for t in trees])
    plen = np.zeros(len(trees), np.int64) if prompt_lens is None else np.asarray(prompt_lens, np.int64)
    if plen.shape != (len(trees),):
        raise ValueError("prompt_lens must have one entry per tree")
    positions = depths + np.repeat(plen, counts)
    max_children = max(int(t.num_children.max()) for t in trees)
    children = np.full((total, max(max_children, 1)), -1, np.int64)
    slot_lists = []
    for t, off in zip(trees, offsets[:-1]):
        for c, kids in enumerate(t.children_lists()):
            if kids:
                children[off + c, : len(kids)] = np.asarray(kids) + off
            slot_lists.append([k + int(off) for k in kids for _ in range(int(t.multiplicity[k]))])
    max_slots = max(1, max(len(s) for s in slot_lists))
    slots = np.full((total, max_slots), -1, np.int64)
    for g, s in enumerate(slot_lists):
        slots[g, : len(s)] = s
    bits = None
    if int(counts.max()) <= 64:
        bits = torch.from_numpy(np.concatenate([t.ancestor_bits for t in trees])).to(device)
    t64 = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return TreeBatch(
        node_offsets=t64(offsets),
        tokens=t64(np.concatenate([t.tokens for t in trees])),
        parents=t64(parents),
        local_parents=t64(local_parents),
        depths=t64(depths),
        positions=t64(positions),
        tree_index=t64(np.repeat(np.arange(len(trees)), counts)),
        root_index=t64(offsets[:-1]),
        sources=t64(np.concatenate([t.sources for t in trees])),
        values=t64(np.concatenate([t.values for t in trees])),
        children=t64(children),
        slots=t64(slots),
        ancestor_bits=bits,
        max_depth=int(depths.max()),
        unmerged=all(bool(np.all(t.multiplicity == 1)) for t in trees),
    )
