"""The injected faults' code at the executor's and the engine's hook points (TESTING ONLY).

faults.py names and parses the kinds (SPECS: knob, default, the real bug each
one imitates); this module is what they do. The executor and the engine hold
one `EngineFault` (None when healthy: every hook site is a single `is not None`
test per step, no per-token work) and consult it at a few named points:

    executor._build_batch   open_pad(mask, pad)            open-pad-column
    executor.decode         scaled(model, bsz)             batch-scale
                            after_decode(kv, n, ids, lens) kv-row-swap
    engine._load_prefix     cached_reported(r)             cached-tokens-off
    engine._prefill_one     prefill_shift(r)               hit-position-offset
                            before_chunk(executor, r)      chunk-boundary
    engine._emit_step       remap_rows(rows, logits)       wrong-row-sample
    engine._token_event     finish(r, tok, reason)         early-stop
                            report(r, ev)                  topk-misorder, stale-logprobs

The prefix-cache kinds (corrupt-prefix-cache, perturb-kv, prefix-key-collision,
prefix-use-after-free) live in prefix_cache.py / faults.py, where the blocks are.
Every hook is a no-op for the other kinds, and magnitude 0 leaves every tensor
and field bitwise as the healthy engine computes it.

Probability knobs are deterministic: `_chance` hashes the fault kind with what
the row itself holds (the token it feeds or chose, its position), so a request
meets the same fault at the same token in every run whatever its batch mates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib

from ..errors import EngineError
from .faults import Fault


def _chance(tag: bytes, *ints: int) -> float:
    """A uniform draw in [0, 1) fixed by (tag, ints): the same row state, the same draw."""
    h = hashlib.blake2b(tag + b",".join(str(int(i)).encode() for i in ints), digest_size=8)
    return int.from_bytes(h.digest(), "little") / 2**64


class EngineFault:
    """One injected fault as the executor and the engine consult it."""

    def __init__(self, fault: Fault):
        self.fault, self.kind, self.mag = fault, fault.kind, fault.mag
        self.n = int(fault.mag)  # the integer knobs (N, K)
        self._tag = fault.kind.encode() + b":"
        self._scaled: list | None = None  # batch-scale: [(attention module, its healthy scaling)]
        self.applied = 0  # how many times a hook changed something (rows, tokens, requests)

    def _fires(self, *ints: int) -> bool:
        return self.mag > 0 and _chance(self._tag, *ints) < self.mag

    # ---- executor ------------------------------------------------------------------------
    def open_pad(self, mask, pad) -> None:
        """open-pad-column: the last N padding columns of each padded row left open (mask 1),
        so the row attends to the padding's KV (a copy of its slot's position 0). mask: [B, cap]
        long, pad: [B] padding columns per row."""
        if self.kind != "open-pad-column" or self.n <= 0:
            return
        import torch

        cols = torch.arange(int(pad.max()), device=mask.device)[None, :]  # [1, max pad]
        opened = (cols < pad[:, None]) & (cols >= pad[:, None] - self.n)  # [B, max pad]
        mask[:, : cols.shape[1]] |= opened.long()
        self.applied += int(opened.any(dim=1).sum())

    def scaled(self, model, bsz: int):
        """batch-scale: every attention module's softmax scale times (1 + EPS), only in a batched
        forward (B > 1); restored exactly afterwards."""
        if self.kind != "batch-scale" or bsz < 2:
            return contextlib.nullcontext()
        if self._scaled is None:
            self._scaled = [(m, m.scaling) for m in model.modules() if isinstance(getattr(m, "scaling", None), float)]
            if not self._scaled:
                raise EngineError("batch-scale: this model's attention modules have no `scaling` to change")
        return self._scale_ctx()

    @contextlib.contextmanager
    def _scale_ctx(self):
        for m, s in self._scaled:
            m.scaling = s * (1 + self.mag)
        self.applied += 1
        try:
            yield
        finally:
            for m, s in self._scaled:
                m.scaling = s

    def after_decode(self, kv, n: int, next_ids: list[int], lengths: list[int]) -> None:
        """kv-row-swap: with probability P per row, the K/V just computed for a row (column n of
        the batch buffer kv: [L, 2, B, Hkv, cap, D]) is overwritten by its next batch mate's, before
        it is written back to the slot. This step's logits are right; every later step reads it."""
        bsz = len(next_ids)
        if self.kind != "kv-row-swap" or bsz < 2:
            return
        rows = [i for i in range(bsz) if self._fires(next_ids[i], lengths[i])]
        if rows:
            mates = [(i + 1) % bsz for i in rows]
            kv[:, :, rows, :, n] = kv[:, :, mates, :, n].clone()
            self.applied += len(rows)

    # ---- engine --------------------------------------------------------------------------
    def cached_reported(self, r) -> int:
        """cached-tokens-off: usage.cached_tokens reported K too high after a hit (capped at the
        prompt length); the KV reused is the true amount."""
        if self.kind != "cached-tokens-off" or r.cached_tokens <= 0 or self.n <= 0:
            return r.cached_tokens
        self.applied += 1
        return min(r.cached_tokens + self.n, len(r.prompt_ids))

    def prefill_shift(self, r) -> int:
        """hit-position-offset: after a prefix hit, the remainder's prefill positions off by K."""
        if self.kind != "hit-position-offset" or r.cached_tokens <= 0 or self.n <= 0:
            return 0
        self.applied += 1
        return self.n

    def before_chunk(self, executor, r) -> None:
        """chunk-boundary: a continuation chunk (one that starts where the previous chunk of this
        prefill ended, not at a cache hit) reads the K positions before its boundary as zeros, as if
        the previous chunk's last writes were lost. The zeros stay in the slot (later steps, and
        the blocks the prompt inserts in the prefix cache, see them too)."""
        if self.kind != "chunk-boundary" or r.length <= r.cached_tokens or self.n <= 0:
            return
        lo = max(r.cached_tokens, r.length - self.n)
        executor.kv[r.slot, :, :, :, lo : r.length] = 0
        self.applied += 1

    def remap_rows(self, rows: list, logits):
        """wrong-row-sample: in a batched step, with probability P a row's token (and its whole
        evidence) is taken from its next batch mate's logits row. logits: [B, V]."""
        bsz = len(rows)
        if self.kind != "wrong-row-sample" or bsz < 2:
            return logits
        idx = [(i + 1) % bsz if self._fires(r.next_id, r.length) else i for i, r in enumerate(rows)]
        if idx == list(range(bsz)):
            return logits
        self.applied += sum(1 for i, j in enumerate(idx) if i != j)
        return logits[idx]

    def finish(self, r, tok: int, reason: str | None) -> str | None:
        """early-stop: with probability P per token, a request still running ends here with
        finish_reason "stop" (its token is no EOS, ignore_eos notwithstanding)."""
        if self.kind != "early-stop" or reason is not None or not self._fires(tok, r.generated):
            return reason
        self.applied += 1
        return "stop"

    def report(self, r, ev):
        """topk-misorder: with probability P the top-k list is reported with its first two entries
        swapped (pairs intact, order wrong). stale-logprobs: with probability P a token is reported
        with the previous step's logprob, logit and top-k (the token id itself is right)."""
        if self.kind == "topk-misorder":
            if len(ev.top_ids) >= 2 and self._fires(ev.token_id, r.generated):
                self.applied += 1
                swap = lambda xs: [xs[1], xs[0], *xs[2:]]  # noqa: E731
                ev = dataclasses.replace(
                    ev, top_ids=swap(ev.top_ids), top_logprobs=swap(ev.top_logprobs), top_logits=swap(ev.top_logits)
                )
        elif self.kind == "stale-logprobs":
            prev, r.fault_state = r.fault_state, ev
            if prev is not None and self._fires(ev.token_id, r.generated):
                self.applied += 1
                ev = dataclasses.replace(
                    ev,
                    logprob=prev.logprob,
                    logit=prev.logit,
                    top_ids=prev.top_ids,
                    top_logprobs=prev.top_logprobs,
                    top_logits=prev.top_logits,
                )
        return ev


def engine_fault(fault: Fault | None) -> EngineFault | None:
    """The hooks object for the executor and the engine (None when healthy or when the fault is
    a prefix-cache kind, which prefix_cache.py applies itself)."""
    if fault is None or fault.spec.hook.startswith("prefix_cache"):
        return None
    return EngineFault(fault)
