"""The prefix cache's keys and eviction, without a server."""

from __future__ import annotations

from tracekit.engine.prefix_cache import PrefixCache, chain_keys


def _kv(start, end):
    import torch

    blk = torch.arange(start, end, dtype=torch.float32)[None, :, None]  # [Hkv=1, n, D=1]
    return [blk], [blk + 0.5]


def test_chain_key_names_the_whole_prefix():
    """Equal blocks after different prefixes must get different keys (else a hit would reuse KV
    computed under another context)."""
    a = chain_keys([1, 2, 3, 4, 5, 6], 3, 2)
    b = chain_keys([9, 2, 3, 4, 5, 6], 3, 2)
    assert a[1] != b[1] and chain_keys([1, 2, 3, 4, 5, 6], 3, 2) == a


def test_lookup_leaves_one_token_and_lru_evicts_oldest():
    c = PrefixCache(block_size=2, capacity_blocks=3)
    seq = [1, 2, 3, 4, 5, 6]
    c.insert(seq, 6, _kv)
    n, blocks = c.lookup(seq)
    assert n == 4 and len(blocks) == 2  # the last block is never reused: its last token must run
    assert blocks[1].keys[0].flatten().tolist() == [2.0, 3.0]
    c.insert([7, 8, 9, 10], 4, _kv)  # 2 new blocks, capacity 3: the least recently used goes
    assert len(c.blocks) == 3
    n, _ = c.lookup(seq)
    assert n == 0  # evicted: seq's unused 3rd block, then its 1st (touched before the 2nd): the chain breaks
    assert c.queries_tokens == 12 and c.hits_tokens == 4
