"""Injected prefix-cache faults (TESTING ONLY): bugs tracekit must catch, on purpose.

Two kinds, both applied to the blocks a prefix-cache hit serves (never to what
is stored, so the cache itself stays healthy and the fault repeats on every hit):

- `corrupt-prefix-cache`: a block-ownership bug. The last reused block is
  served with the KV of a different cached block (as if its storage had been
  freed and handed to another sequence), or, when no other block exists, with
  its positions rotated by one. Far larger than any numeric noise.
- `perturb-kv:EPS`: a graded fault. Every reused block is served scaled by
  `1 + EPS * noise`, noise a standard normal per element drawn from a
  generator seeded by the block's own chain key, so the same block always gets
  the same noise whatever the order of requests (serial and concurrent runs see
  the same fault). EPS = 0 is bitwise the healthy engine. `bench/sensitivity.py`
  sweeps EPS to measure the smallest corruption `tracekit diff` flags.

Each application is logged (`FaultLog`): how many KV values it actually
changed. In BF16 a small EPS rounds back to the same value for most or all
elements, so "the request hit the cache" is not "the request was corrupted".
"""

from __future__ import annotations

import collections
import hashlib
import math
import threading
from dataclasses import dataclass

from ..errors import ConfigError
from .kvblock import Block

KINDS = ("corrupt-prefix-cache", "perturb-kv:EPS")
NOISE_SEED = 0x7472616365  # mixed into every block's noise seed ("trace")


@dataclass(frozen=True)
class Fault:
    kind: str  # corrupt-prefix-cache | perturb-kv
    eps: float = 0.0

    @property
    def name(self) -> str:
        """The canonical spelling, as /v1/models meta.inject_fault reports it."""
        return f"perturb-kv:{self.eps!r}" if self.kind == "perturb-kv" else self.kind


def parse_fault(text: str | None) -> Fault | None:
    """`corrupt-prefix-cache` or `perturb-kv:EPS` (EPS a finite number >= 0) -> Fault; None -> None."""
    if text is None:
        return None
    name, sep, arg = text.strip().partition(":")
    if name == "corrupt-prefix-cache" and not sep:
        return Fault(name)
    if name == "perturb-kv" and sep:
        try:
            eps = float(arg)
        except ValueError:
            eps = math.nan
        if math.isfinite(eps) and eps >= 0:
            return Fault(name, eps)
        raise ConfigError(f"--inject-fault {text!r}: EPS must be a finite number >= 0, e.g. perturb-kv:0.01")
    raise ConfigError(f"--inject-fault {text!r}: expected one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class FaultRecord:
    """One prefix-cache hit served through the fault."""

    prompt_sha256: str  # prompt_ids_sha256 of the request's prompt ids
    prompt_tokens: int
    cached_tokens: int
    kv_values: int  # values (K and V elements) served from the cache
    kv_values_changed: int  # of those, how many differ from the healthy cache's


def prompt_ids_sha256(ids) -> str:
    """sha256 of the prompt ids written as `1,2,3` (what a client can compute from its own ids)."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


class FaultLog:
    """The last `maxlen` fault applications, oldest first (GET /fault_log). Written by the owner
    loop, read by the HTTP thread."""

    def __init__(self, maxlen: int = 100_000):
        self._records: collections.deque[FaultRecord] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.total = 0

    def add(self, rec: FaultRecord) -> None:
        with self._lock:
            self._records.append(rec)
            self.total += 1

    def snapshot(self) -> tuple[int, list[FaultRecord]]:
        """(applications ever, the kept records oldest first)."""
        with self._lock:
            return self.total, list(self._records)


def apply_fault(
    fault: Fault, found: list[Block], keys: list[bytes], cached, prompt: list[int], log: FaultLog
) -> list[Block]:
    """The blocks to serve instead of `found` (keys: their chain keys; cached: an iterator over
    every cached (key, block), newest first). Logs how many values changed."""
    if fault.kind == "corrupt-prefix-cache":
        served = found[:-1] + [_foreign_block(found[-1], set(keys), cached)]
    else:
        served = [_perturbed(b, k, fault.eps) for b, k in zip(found, keys)]
    total = changed = 0
    for old, new in zip(found, served):
        for a, b in zip(old.keys + old.values, new.keys + new.values):
            total += a.numel()
            changed += int((a != b).sum())
    bs = found[0].keys[0].shape[1]
    log.add(FaultRecord(prompt_ids_sha256(prompt), len(prompt), len(found) * bs, total, changed))
    return served


def _foreign_block(blk: Block, own: set[bytes], cached) -> Block:
    import torch

    other = next((b for k, b in cached if k not in own), None)
    if other is not None:
        return Block([k.clone() for k in other.keys], [v.clone() for v in other.values])
    return Block([torch.roll(k, 1, dims=1) for k in blk.keys], [torch.roll(v, 1, dims=1) for v in blk.values])


def _perturbed(blk: Block, key: bytes, eps: float) -> Block:
    """blk * (1 + eps * noise), computed in float32 and rounded back to the KV dtype."""
    import torch

    seed = (int.from_bytes(key[:8], "little") ^ NOISE_SEED) & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    tensors = blk.keys + blk.values  # per layer [Hkv, block_size, D]
    # One draw for the whole block, on CPU (so the noise does not depend on the device).
    noise = torch.randn((len(tensors), *tensors[0].shape), generator=gen, dtype=torch.float32)
    scale = (1 + eps * noise).to(tensors[0].device)
    out = [(t.float() * s).to(t.dtype) for t, s in zip(tensors, scale)]
    n = len(blk.keys)
    return Block(out[:n], out[n:])
