"""Block-granular prefix cache: KV blocks keyed by a hash chain of their tokens, LRU-evicted.

Block i of a sequence is keyed by hash(key of block i-1, tokens of block i),
so a key names the whole prefix up to the block's end, as in vLLM. A lookup
walks the prompt's full blocks and stops at the first miss; at least one
prompt token is always left to compute, because its logits start the output.

An injected fault (faults.py, testing only) changes the blocks a hit serves,
never the stored ones (corrupt-prefix-cache, perturb-kv), or imitates a cache
bug in the keys (prefix-key-collision: a block's hash ignores its last N
tokens) or in ownership (prefix-use-after-free: the last block a hit reuses is
also put on a free list, and the next new block is written into its storage).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from .faults import PREFIX_KV_KINDS, Fault, FaultLog, apply_fault
from .kvblock import Block

ROOT = b"tracekit-prefix-root"


def chain_keys(tokens: list[int], block_size: int, n_blocks: int, ignore_tail: int = 0) -> list[bytes]:
    """Hash-chain keys of the first n_blocks full blocks of tokens. ignore_tail > 0 only under the
    injected fault prefix-key-collision: each block's last ignore_tail tokens are left out."""
    keys, prev = [], ROOT
    for b in range(n_blocks):
        blk = tokens[b * block_size : (b + 1) * block_size - ignore_tail]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b",".join(str(t).encode() for t in blk))
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass
class PrefixCache:
    block_size: int = 16
    capacity_blocks: int = 4096
    fault: Fault | None = None
    blocks: OrderedDict = field(default_factory=OrderedDict)  # key -> Block, oldest first
    queries_tokens: int = 0
    hits_tokens: int = 0
    fault_log: FaultLog = field(default_factory=FaultLog)
    freed: list = field(default_factory=list)  # prefix-use-after-free: blocks a hit "freed" while reusing them

    def __post_init__(self):
        f = self.fault
        self._tail = int(f.mag) if f is not None and f.kind == "prefix-key-collision" else 0
        self._uaf = int(f.mag) if f is not None and f.kind == "prefix-use-after-free" else 0

    def lookup(self, tokens: list[int]) -> tuple[int, list[Block]]:
        """Longest cached block-aligned prefix: (number of tokens, blocks in order). Counts the query."""
        usable = (len(tokens) - 1) // self.block_size
        self.queries_tokens += len(tokens)
        found: list[Block] = []
        keys = chain_keys(tokens, self.block_size, usable, self._tail)
        for key in keys:
            blk = self.blocks.get(key)
            if blk is None:
                break
            self.blocks.move_to_end(key)  # most recently used
            found.append(blk)
        n = len(found) * self.block_size
        self.hits_tokens += n
        if found and self._uaf:
            self.freed.append(found[-1])  # the bug: on the free list AND still mapped under its key
        if found and self.fault is not None and self.fault.kind in PREFIX_KV_KINDS:
            newest_first = reversed(self.blocks.items())
            found = apply_fault(self.fault, found, keys[: len(found)], newest_first, tokens, self.fault_log)
        return n, found

    def insert(self, tokens: list[int], n_tokens: int, get_kv) -> None:
        """Cache the full blocks of tokens[:n_tokens]. get_kv(start, end) -> (keys, values) per layer."""
        n_blocks = n_tokens // self.block_size
        for i, key in enumerate(chain_keys(tokens, self.block_size, n_blocks, self._tail)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            ks, vs = get_kv(i * self.block_size, (i + 1) * self.block_size)
            self.blocks[key] = Block(ks, vs)
            if self.freed:  # prefix-use-after-free: the new block's KV also lands in a freed block's storage
                self._reuse(self.freed.pop(0), ks, vs)
            while len(self.blocks) > self.capacity_blocks:
                self.blocks.popitem(last=False)

    def _reuse(self, victim: Block, ks, vs) -> None:
        """Overwrite the victim's first N positions in place (per layer [Hkv, block_size, D])."""
        n = self._uaf
        for dst, src in zip(victim.keys + victim.values, ks + vs):
            dst[:, :n] = src[:, :n]
        self.fault_log.total += 1

    def clear(self) -> int:
        """Drop every block (POST /reset_prefix_cache); returns how many were held."""
        n = len(self.blocks)
        self.blocks.clear()
        self.freed.clear()
        return n
