# SPDX-License-Identifier: Apache-2.0
import numpy as np
import torch

from sglang.srt.speculative.ddtree.tree_build import DraftTree


def random_tree(rng: np.random.Generator, bs: int, budget: int, num_depths: int, vocab: int,
                pad_prob: float = 0.0) -> DraftTree:
    """Random valid trees in DDTree's numbering (parent < child, distinct
    sibling tokens, siblings in rank order), optionally with padded tails."""
    token = np.zeros((bs, budget), dtype=np.int64)
    parent = np.full((bs, budget), -1, dtype=np.int32)
    depth = np.zeros((bs, budget), dtype=np.int32)
    rank = np.zeros((bs, budget), dtype=np.int32)
    num = np.zeros((bs,), dtype=np.int32)
    for b in range(bs):
        n_real = budget if rng.random() >= pad_prob else int(rng.integers(0, budget + 1))
        used = {0: set()}  # parent -> tokens already used by its children
        depth_of = {0: 0}
        for i in range(n_real):
            node = i + 1
            options = [p for p in range(node) if depth_of[p] < num_depths and len(used[p]) < vocab]
            if not options:
                n_real = i
                break
            p = int(rng.choice(options))
            free = [t for t in range(vocab) if t not in used[p]]
            tok = int(rng.choice(free))
            rank[b, i] = len(used[p])
            used[p].add(tok)
            used[node] = set()
            depth_of[node] = depth_of[p] + 1
            token[b, i], parent[b, i], depth[b, i] = tok, p, depth_of[node]
        num[b] = n_real
    return DraftTree(
        node_token=torch.from_numpy(token),
        node_parent=torch.from_numpy(parent),
        node_depth=torch.from_numpy(depth),
        node_rank=torch.from_numpy(rank),
        node_score=torch.zeros((bs, budget), dtype=torch.float32),
        num_nodes=torch.from_numpy(num),
    )
