"""A radix tree over token spans holding their KV (and R3 routing rows), for the embedded engine.

Why: an agent episode's next turn resends its whole history, and a group's n samples share one
prompt; without a cache the engine recomputes that KV every time. As in SGLang's RadixAttention, each
edge of the tree is a span of tokens with the keys/values the model computed for them, so a request
finds its longest cached prefix by walking from the root and only the rest is prefilled.

Storage: the tree holds its own copies, ``[layers, kv_heads, span, head_dim]`` per node; a hit copies
the prefix into the request's KV slot (a memcpy, no compute), so the decode path keeps reading one
dense slot per sequence and a running request never pins tree memory. ``max_tokens`` caps the tokens
held; the least recently used leaves go first, as in SGLang.

What a cached prefix must keep (the engine's guarantees): routing rows are stored beside the KV, and a
request that wants them only reuses nodes that have them; the engine clears the tree whenever weights
change, so no KV from old weights survives an update.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

KVReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (start, end) -> k, v [L, H, n, D]


class _Node:
    __slots__ = ("children", "k", "last_used", "parent", "routing", "tokens", "v")

    def __init__(self, tokens: tuple[int, ...], k: torch.Tensor | None, v: torch.Tensor | None,
                 routing: np.ndarray | None, parent: _Node | None) -> None:
        self.tokens, self.k, self.v, self.routing, self.parent = tokens, k, v, routing, parent
        self.children: dict[int, _Node] = {}
        self.last_used = 0


def _common(a: tuple[int, ...], b: list[int]) -> int:
    """Length of the common prefix of a node's span and the request's remaining tokens."""
    n = min(len(a), len(b))
    if tuple(b[:n]) == a[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Longest-prefix lookup, insertion and LRU eviction of KV spans (see module docstring)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(0, int(max_tokens))
        self.root = _Node((), None, None, None, None)
        self.tokens = 0  # tokens held by all nodes
        self._clock = itertools.count(1)

    def clear(self) -> None:
        self.root = _Node((), None, None, None, None)
        self.tokens = 0

    def nbytes(self) -> int:
        """Bytes of KV the tree holds."""
        return sum(n.k.nbytes + n.v.nbytes for n in self._nodes() if n.k is not None and n.v is not None)

    def match(self, tokens: list[int], limit: int, need_routing: bool) -> tuple[int, list[tuple[_Node, int]]]:
        """The longest cached prefix of ``tokens[:limit]``: its length and the (node, tokens used) path."""
        node, pos, path = self.root, 0, []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None or (need_routing and child.routing is None):
                break
            used = _common(child.tokens, tokens[pos:limit])
            child.last_used = now
            path.append((child, used))
            pos += used
            if used < len(child.tokens):
                break
            node = child
        return pos, path

    @staticmethod
    def gather(path: list[tuple[_Node, int]]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
        """The path's KV ``[L, H, n, D]`` (and routing rows, when every node has them), concatenated."""
        k = torch.cat([node.k[:, :, :used] for node, used in path], dim=2)
        v = torch.cat([node.v[:, :, :used] for node, used in path], dim=2)
        rows = [None if node.routing is None else node.routing[:used] for node, used in path]
        routing = np.concatenate(rows) if all(r is not None for r in rows) else None
        return k, v, routing

    def insert(self, tokens: list[int], read_kv: KVReader, routing: np.ndarray | None) -> None:
        """Add ``tokens`` (whose KV ``read_kv(start, end)`` returns) to the tree, then evict down to the cap.

        ``routing`` holds a row per token or is None; it also fills in rows a shared node lacked.
        """
        if self.max_tokens <= 0 or not tokens:
            return
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                k, v = read_kv(pos, len(tokens))
                rows = None if routing is None else routing[pos:len(tokens)].copy()
                leaf = _Node(tuple(tokens[pos:]), k.clone(), v.clone(), rows, node)
                leaf.last_used = now
                node.children[tokens[pos]] = leaf
                self.tokens += len(leaf.tokens)
                break
            used = _common(child.tokens, tokens[pos:])
            if used < len(child.tokens):
                child = self._split(child, used)
            if child.routing is None and routing is not None:
                child.routing = routing[pos:pos + used].copy()
            child.last_used = now
            node, pos = child, pos + used
        self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; returns the new upper half (the lower keeps the children)."""
        assert node.parent is not None and node.k is not None and node.v is not None
        head = _Node(node.tokens[:at], node.k[:, :, :at].clone(), node.v[:, :, :at].clone(),
                     None if node.routing is None else node.routing[:at].copy(), node.parent)
        head.last_used = node.last_used
        node.parent.children[node.tokens[0]] = head
        node.tokens, node.parent = node.tokens[at:], head
        node.k, node.v = node.k[:, :, at:].clone(), node.v[:, :, at:].clone()
        node.routing = None if node.routing is None else node.routing[at:].copy()
        head.children[node.tokens[0]] = node
        return head

    def _evict(self) -> None:
        if self.tokens <= self.max_tokens:
            return
        leaves = [n for n in self._nodes() if not n.children]
        leaves.sort(key=lambda n: n.last_used)
        while self.tokens > self.max_tokens and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self.tokens -= len(leaf.tokens)
            if parent is not self.root and not parent.children:  # the parent became a leaf: keep LRU order
                i = 0
                while i < len(leaves) and leaves[i].last_used <= parent.last_used:
                    i += 1
                leaves.insert(i, parent)

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
