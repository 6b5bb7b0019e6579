"""Token trees: the shapes a proposal takes and the structures that verify it in one target call.

    TokenTrie       drafted continuations merged into a trie (shared prefixes once), its node
                    positions and ancestor mask for one batch-1 call with a 4D attention mask
    DraftTree       a draft tree grown over several draft calls: OPT-Tree's top nodes by path
                    probability (greedy), or Sequoia's fixed shape filled by sampling
    SequoiaShape    the fixed shape of a Sequoia tree (the nodes with the highest expected acceptance)
    top_ids         the few highest-logit ids of each row, for branching

Pure NumPy; docs/ALGORITHMS.md explains each structure.
"""

from __future__ import annotations

import heapq

import numpy as np

# Probability that the rank-r child drawn at a node is the accepted one, at temperature 1 with the
# default bundle (Qwen2.5-Coder 0.5B int4 draft, 1.5B target: sum min(p, q) = 0.705 for the first
# draw, as measured teacher-forced on real text; later draws, without replacement, from the Sequoia paper's decay); they only
# shape the tree, never the output law.
SEQUOIA_RANK_ACCEPTANCE = (0.70, 0.12, 0.05, 0.03, 0.02, 0.01)


class SequoiaShape:
    """The tree of `budget` nodes with the highest expected acceptance, depth <= max_depth: each
    node's value is the product of its path's rank acceptances, and the best tree of n nodes is
    the n highest-valued nodes of the infinite tree (values fall along every path and sibling
    rank, so that set is a tree: the dynamic program of Sequoia, solved greedily).
    children[s] = how many children shape node s has; child(s, r) = its rank-r child; value[s] = the
    chance s is accepted under `accept` (the root's 1.0 included, sum(value) = expected tokens per step)."""

    def __init__(self, budget: int, max_depth: int, accept=SEQUOIA_RANK_ACCEPTANCE):
        self.children, self.depth, self.value, self._child = [0], [0], [1.0], {}
        heap = [(-accept[0], 0, 0)]                    # (-value, parent, rank)
        while heap and len(self.depth) - 1 < budget:
            neg, parent, rank = heapq.heappop(heap)
            node = len(self.depth)
            self.depth.append(self.depth[parent] + 1)
            self.value.append(-neg)
            self.children.append(0)
            self.children[parent] += 1
            self._child[(parent, rank)] = node
            if rank + 1 < len(accept):
                heapq.heappush(heap, (neg / accept[rank] * accept[rank + 1], parent, rank + 1))
            if self.depth[node] < max_depth:
                heapq.heappush(heap, (neg * accept[0], node, 0))

    def child(self, node: int, rank: int) -> int:
        return self._child[(node, rank)]


def sequoia_shape(budget: int, max_depth: int) -> SequoiaShape:
    return SequoiaShape(budget, max_depth)


class DraftTree:
    """A greedy draft tree grown by path probability (OPT-Tree, docs/ALGORITHMS.md).

    Node 0 is the last committed token. `grow` adds, below the frontier nodes, their draft's
    top children, then keeps the `budget` nodes (root excluded) with the highest path
    log-probability; a child's path probability never exceeds its parent's, so the kept set is
    a tree (ties are closed over explicitly). fed[node] = the node's draft-cache position once
    the draft has scored it.
    """

    WIDTH = 4            # children considered per frontier node

    def __init__(self, root_token: int, budget: int):
        self.budget = budget
        self.tokens, self.parent, self.depth, self.logp = [int(root_token)], [-1], [0], [0.0]
        self.fed: list[int | None] = [None]
        self.kept: set[int] = set()
        self.children: dict[tuple[int, int], int] = {}
        self.kids: dict[int, list[int]] = {}         # node -> its children in the order they were added
        self.draft_probs: dict[int, np.ndarray] = {}  # sampled trees: node -> the draft probs its children came from

    def add_child(self, parent: int, token: int) -> int:
        """Append a kept child (sampled trees, which keep every node they draw)."""
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.logp.append(0.0)
        self.fed.append(None)
        self.children[(parent, int(token))] = node
        self.kids.setdefault(parent, []).append(node)
        self.kept.add(node)
        return node

    def grow(self, frontier: list[int], logits: np.ndarray) -> list[int]:
        """logits # [len(frontier), V] from the draft at the frontier; returns the new kept nodes."""
        width = min(self.WIDTH, self.budget, logits.shape[-1])
        top = top_ids(logits, width)                                                          # [f, width]
        z = logits.max(-1, keepdims=True)
        lse = (z + np.log(np.exp(logits - z).sum(-1, keepdims=True)))[:, 0]                  # [f]
        pool = [(self.logp[n], n, None) for n in self.kept]
        for fi, node in enumerate(frontier):
            for t in top[fi]:
                pool.append((self.logp[node] + float(logits[fi, t] - lse[fi]), node, int(t)))
        pool.sort(key=lambda e: -e[0])
        keep = pool[:self.budget]
        new = []
        self.kept = {n for _, n, t in keep if t is None}
        for lp, parent, tok in keep:
            if tok is None:
                continue
            node = len(self.tokens)
            self.tokens.append(tok)
            self.parent.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.logp.append(lp)
            self.fed.append(None)
            self.children[(parent, tok)] = node
            self.kept.add(node)
            new.append(node)
        # close over ties: a node whose parent fell out goes too
        for node in sorted(self.kept):
            if self.parent[node] != 0 and self.parent[node] not in self.kept:
                self.kept.discard(node)
        return [n for n in new if n in self.kept]

    def path(self, node: int) -> list[int]:
        """The drafted tokens from the root to `node`, root excluded."""
        return [self.tokens[n] for n in reversed([node] + self.ancestors_of(node))] if node else []

    def ancestors_of(self, node: int) -> list[int]:
        out = []
        node = self.parent[node]
        while node > 0:
            out.append(node)
            node = self.parent[node]
        return out

    def rows(self) -> list[list[int]]:
        """Root-to-leaf token paths of the kept tree (the root itself excluded)."""
        inner = {self.parent[n] for n in self.kept}
        rows = []
        for leaf in sorted(n for n in self.kept if n not in inner):
            path, node = [], leaf
            while node > 0:
                path.append(self.tokens[node])
                node = self.parent[node]
            rows.append(path[::-1])
        return rows or [[]]

    def fed_path(self, tokens) -> list[int]:
        """Draft-cache positions along the path of `tokens` from the root, up to the first node not fed."""
        node, out = 0, []
        for tok in tokens:
            node = self.children.get((node, int(tok)))
            if node is None or self.fed[node] is None:
                break
            out.append(self.fed[node])
        return out


class TokenTrie:
    """Drafted continuations merged into a token trie, for one batch-1 target call (docs/ALGORITHMS.md).

    Node 0 is the last committed token (position past); every other node is a drafted token,
    identical prefixes shared. tokens # [N], depth # [N] (position = past + depth),
    ancestors # [N, N] bool (node i attends to node j: j is i or an ancestor of i),
    children {(node, token): child}, node_of # [u, L+1] for equal-length rows: the node of
    row r at depth j (node_of[r, 0] = 0). Rows may differ in length (greedy side leaves);
    node_of is then None. A child's index is always larger than its parent's, so a path's
    nodes are ascending.
    """

    def __init__(self, root_token: int, rows):
        lengths = {len(r) for r in rows}
        tokens, parent, depth = [int(root_token)], [-1], [0]
        self.children: dict[tuple[int, int], int] = {}
        node_of = []
        for row in rows:
            node, path = 0, [0]
            for j, tok in enumerate(row):
                key = (node, int(tok))
                child = self.children.get(key)
                if child is None:
                    child = self.children[key] = len(tokens)
                    tokens.append(key[1])
                    parent.append(node)
                    depth.append(j + 1)
                node = child
                path.append(node)
            node_of.append(path)
        self.node_of = np.asarray(node_of, dtype=np.int64) if len(lengths) == 1 else None
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.depth = np.asarray(depth, dtype=np.int64)
        self.parent, self._ancestors = parent, None

    @property
    def ancestors(self) -> np.ndarray:
        """# [N, N] bool: node i attends to node j (j is i or an ancestor of i); made when first asked."""
        if self._ancestors is None:
            n = len(self.parent)
            self._ancestors = np.eye(n, dtype=bool)
            for i in range(1, n):                 # parent[i] < i: its row is already complete
                self._ancestors[i] |= self._ancestors[self.parent[i]]
        return self._ancestors

    def row_view(self, node_logits: np.ndarray) -> "RowLogits":
        """target_logits[row, j] of the replicated layout, read from per-node logits # [N, W]."""
        return RowLogits(node_logits, self.node_of)


class RowLogits:
    """target_logits[row, j] of the replicated layout, read from per-node logits # [N, W]."""

    def __init__(self, node_logits: np.ndarray, node_of: np.ndarray):
        self.node_logits, self.node_of = node_logits, node_of

    def __getitem__(self, index) -> np.ndarray:
        row, j = index
        return self.node_logits[self.node_of[row, j]]


def top_ids(logits: np.ndarray, count: int) -> np.ndarray:
    """The `count` highest-logit ids of each row of logits # [..., V], highest first, ties to the
    lower id: # [..., count].

    `count` passes of argmax, each hiding the ids found so far (set to -inf, put back after): for
    the few ids a draft tree branches on, ~10x faster than argpartition over a 151,936-wide
    vocabulary (5 ms per draft call of the float32 bundle's trees, 6% of their time). A read-only
    array is copied first."""
    work = logits if logits.flags.writeable else logits.copy()
    rows = work.reshape(-1, work.shape[-1])
    index = np.arange(rows.shape[0])
    count = min(count, rows.shape[1])
    out = np.empty((rows.shape[0], count), dtype=np.int64)
    saved = np.empty((rows.shape[0], count), dtype=rows.dtype)
    for j in range(count):
        out[:, j] = rows.argmax(-1)
        saved[:, j] = rows[index, out[:, j]]
        rows[index, out[:, j]] = -np.inf
    for j in reversed(range(count)):     # reversed: where an all -inf row repeats an id, its first value wins
        rows[index, out[:, j]] = saved[:, j]
    return out.reshape(logits.shape[:-1] + (count,))
