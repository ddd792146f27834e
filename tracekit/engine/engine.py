"""The owner loop: one thread holds the model, N slots, a waiting queue and the prefix cache.

Each iteration: take new submissions, cancellations and control calls
(`call`, e.g. emptying the prefix cache, run between steps), free the slots of
cancelled requests, admit waiting requests into free slots (reusing the
longest cached block-aligned prefix), advance every prefilling request by one
prefill forward (the whole rest of its prompt, or one chunk of
`prefill_chunk` tokens, so long prompts do not stall the others), then run ONE
batched decode forward over every slot that has finished its prefill. New requests therefore join
between decode steps (continuous batching). Results leave through each
request's `emit` callback. With `post` unset, `emit` is called on the loop
thread and must be thread-safe; with `post` set (the HTTP server passes its
event loop's `call_soon_threadsafe`), one step's events for all rows travel in
ONE posted call and `emit` runs on the poster's side. The loop knows nothing
about text or HTTP.

A failure is confined to the request that caused it: admission, prefill and
token selection run per request, and a failed batched decode is retried row by
row, so only the rows that fail alone get an error event; the others go on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the executor imports torch; this module stays importable without it
    from .executor import ModelExecutor
    from .prefix_cache import PrefixCache

log = logging.getLogger("tracekit.engine")


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float
    logit: float
    top_ids: list[int]
    top_logprobs: list[float]
    top_logits: list[float]
    finish: str | None = None  # set on a request's last token: "stop" (EOS) | "length"


@dataclass(frozen=True)
class PromptRow:
    """One prompt position's evidence (prompt_logprobs): the logprob, logit and rank of the prompt
    token at `pos`, computed from the logits at pos - 1, and that row's top-k."""

    pos: int
    token_id: int
    logprob: float
    logit: float
    rank: int  # 1 + how many ids have a strictly larger logit
    top_ids: list[int]
    top_logprobs: list[float]
    top_logits: list[float]


@dataclass(frozen=True)
class ErrorEvent:
    message: str


@dataclass(frozen=True)
class _Call:
    """A function to run on the owner thread between steps; its result goes to `future`."""

    fn: Callable[[], object]
    future: concurrent.futures.Future


@dataclass(eq=False)
class GenRequest:
    """One generation. Fields above `emit` come from the client; the rest is loop state."""

    prompt_ids: list[int]
    max_tokens: int
    logprobs: int = 0  # top-k width (0 = chosen token only)
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # vLLM's: top-k width of each prompt position's row (None = off)
    forced: tuple[int, ...] = ()  # teacher forcing: these ids are fed back instead of the chosen ones
    emit: Callable[[object], None] = print
    cancel_reason: str | None = None  # set by the client side: "cancelled" | "stop"
    slot: int = -1
    length: int = 0  # KV positions filled in the slot
    next_id: int = -1  # last chosen token, not yet in the KV
    generated: int = 0
    cached_tokens: int = 0
    cached_tokens_reported: int = 0  # usage.cached_tokens (cached_tokens unless a fault misreports it)
    prefilling: bool = False  # admitted, prompt KV not complete yet
    prompt_rows: list = field(default_factory=list)  # PromptRow per computed prompt position (prompt_logprobs)
    generator: object = None
    fault_state: object = None  # an injected fault's per-request memory (faults_hooks.py)


@dataclass
class Counters:
    """Monotonic counters for /metrics (tokens unless named otherwise)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)  # by finish reason
    cancelled: int = 0
    errors: int = 0
    prefills: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    busy_s: float = 0.0  # wall seconds the owner loop spent admitting and decoding


class Engine:
    """Owns the model executor. Call start(); submit() and cancel() are safe from any thread."""

    def __init__(
        self,
        executor: ModelExecutor,
        prefix_cache: PrefixCache | None,
        post: Callable[[Callable[[], None]], None] | None = None,
        threads: int = 0,
        prefill_chunk: int = 0,
        fault=None,
        invariant_block: int = 0,
    ):
        self.executor, self.cache, self.post, self.threads = executor, prefix_cache, post, threads
        self.prefill_chunk = prefill_chunk  # tokens per prefill step; 0 = the whole prompt
        # > 0 (--batch-invariant, the block size): every prefill forward covers exactly one block
        # [j*B, (j+1)*B) of the prompt (or its last, partial one), so each position's KV and the
        # last position's logits come from a forward of the same shape over the same past, whatever
        # prefix the cache served. Kernels are not row-invariant over the number of query rows
        # (BF16 on CPU: one prompt prefilled from 16 vs from 112 differs by 0.0156-0.0625 in its
        # last logits), so a split that depends on the cache history would change the bits.
        self.invariant_block = invariant_block
        self.fault = fault  # faults_hooks.EngineFault (TESTING ONLY; None = healthy), shared with the executor
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.active: list[GenRequest] = []
        self.free_slots = list(range(executor.slots))[::-1]
        self.counters = Counters()
        # Requests put in the inbox / taken out of it: each written by one thread only, so
        # their difference is the inbox's request count (qsize also counts wake-ups).
        self._submitted = self._drained = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tracekit-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout=10)

    def submit(self, req: GenRequest) -> None:
        self._submitted += 1
        self.inbox.put(req)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run fn() on the owner thread between two steps (the model and the prefix cache are
        only touched there); the returned future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(_Call(fn, fut))
        return fut

    def cancel(self, req: GenRequest, reason: str = "cancelled") -> None:
        """Release the request's slot at the next loop iteration (within one decode step)."""
        if req.cancel_reason is None:
            req.cancel_reason = reason
        self.inbox.put(None)  # wake the loop if idle

    def snapshot(self) -> dict:
        return {
            "running": len(self.active),
            "waiting": len(self.waiting) + max(0, self._submitted - self._drained),
            "slots_busy": self.executor.slots - len(self.free_slots),
            "slots": self.executor.slots,
        }

    def _loop(self) -> None:
        if self.threads:  # OpenMP thread counts are per calling thread: set it where forwards run
            import torch

            torch.set_num_threads(self.threads)
        while not self._stop.is_set():
            self._drain(block=not self.active and not self.waiting)
            self._reap()
            t0 = time.perf_counter()
            try:
                self._admit()
                self._prefill_step()
                self._decode_step()
            except Exception as e:  # failures are caught per request below; this is the last resort
                log.exception("engine step failed outside any one request")
                for r in list(self.active):
                    self._fail(r, e, logged=True)
            self.counters.busy_s += time.perf_counter() - t0

    def run_until_idle(self) -> None:
        """Serve everything submitted, on the calling thread (benches and offline use; never
        while the owner thread runs)."""
        self._drain(block=False)
        while self.waiting or self.active:
            self._reap()
            self._admit()
            self._prefill_step()
            self._decode_step()
            self._drain(block=False)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if isinstance(item, _Call):
                    self._run_call(item)
                elif item is not None:
                    self._drained += 1
                    self.waiting.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    @staticmethod
    def _run_call(c: _Call) -> None:
        try:
            c.future.set_result(c.fn())
        except Exception as e:  # handed to the caller, who reports it
            c.future.set_exception(e)

    def _fail(self, r: GenRequest, e: Exception, logged: bool = False) -> None:
        """End one request with an error event; the others are not touched."""
        if not logged:
            log.exception("request failed inside the engine (only this request is ended)")
        if r in self.waiting:
            self.waiting.remove(r)
        self._release(r)
        self.counters.errors += 1
        self._deliver([(r, ErrorEvent(f"engine error: {type(e).__name__}: {e}"))])

    def _reap(self) -> None:
        """Drop cancelled requests: waiting ones from the queue, active ones from their slots."""
        for r in [r for r in self.waiting if r.cancel_reason]:
            self.waiting.remove(r)
            self._count_end(r)
        for r in [r for r in self.active if r.cancel_reason]:
            self._release(r)
            self._count_end(r)

    def _count_end(self, r: GenRequest) -> None:
        if r.cancel_reason == "cancelled":
            self.counters.cancelled += 1
        else:
            self.counters.finished[r.cancel_reason] += 1

    def _release(self, r: GenRequest) -> None:
        if r in self.active:
            self.active.remove(r)
            self.free_slots.append(r.slot)
            r.slot = -1

    def _admit(self) -> None:
        """Give waiting requests free slots and their cached prefix KV; computing starts next."""
        while self.free_slots and self.waiting:
            r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            self.active.append(r)
            try:
                self._load_prefix(r)
            except Exception as e:  # e.g. a seed torch cannot take: this request only
                self._fail(r, e)

    def _load_prefix(self, r: GenRequest) -> None:
        start = 0
        if self.cache is not None:
            start, blocks = self.cache.lookup(r.prompt_ids)
            for i, blk in enumerate(blocks):
                self.executor.load_kv(r.slot, i * self.cache.block_size, blk.keys, blk.values)
        r.cached_tokens, r.length, r.prefilling = start, start, True
        r.cached_tokens_reported = start if self.fault is None else self.fault.cached_reported(r)
        self.counters.prompt_tokens += len(r.prompt_ids)
        if r.seed is not None and r.temperature > 0:
            import torch

            r.generator = torch.Generator().manual_seed(r.seed)

    def _prefill_step(self) -> None:
        """One prefill forward per prefilling request; the last one yields its first token."""
        for r in [r for r in self.active if r.prefilling]:
            try:
                self._prefill_one(r)
            except Exception as e:
                self._fail(r, e)

    def _prefill_one(self, r: GenRequest) -> None:
        run = self.executor
        n = len(r.prompt_ids)
        end = n if self.prefill_chunk <= 0 else min(n, r.length + self.prefill_chunk)
        b = self.invariant_block
        while r.length < end:  # one forward, or one per block under --batch-invariant (see __init__)
            stop = end if b <= 0 else min(end, (r.length // b + 1) * b)
            if r.prompt_logprobs is not None:  # every position's logits; the last starts the output
                rows = run.prefill(r.slot, r.prompt_ids[:stop], r.length, all_logits=True)
                self._prompt_rows(r, r.length, rows)
                logits = rows[-1:]
            elif self.fault is None:
                logits = run.prefill(r.slot, r.prompt_ids[:stop], r.length)
            else:
                self.fault.before_chunk(run, r)
                logits = run.prefill(r.slot, r.prompt_ids[:stop], r.length, self.fault.prefill_shift(r))
            r.length = stop
            self.counters.prefills += 1
        if end < n:
            return
        r.prefilling = False
        if self.cache is not None:
            self.cache.insert(r.prompt_ids, n, lambda a, b, s=r.slot: run.kv_slice(s, a, b))
        self._emit_step([r], logits)

    @staticmethod
    def _prompt_rows(r: GenRequest, start: int, rows) -> None:
        """PromptRows for the prompt tokens at start+1 .. start+len(rows)-1 ... and the one at
        start+len(rows) when it is still a prompt token (rows[i] predicts position start+i+1)."""
        import torch

        raw = rows.float()
        lp = torch.log_softmax(raw, dim=-1)
        k = r.prompt_logprobs
        top_logits, top_ids = torch.topk(raw, max(k, 1), dim=-1)
        for i in range(raw.shape[0]):
            pos = start + i + 1
            if pos >= len(r.prompt_ids):
                break
            tok = r.prompt_ids[pos]
            r.prompt_rows.append(
                PromptRow(
                    pos,
                    tok,
                    float(lp[i, tok]),
                    float(raw[i, tok]),
                    int((raw[i] > raw[i, tok]).sum()) + 1,
                    top_ids[i, :k].tolist(),
                    lp[i].gather(0, top_ids[i, :k]).tolist(),
                    top_logits[i, :k].tolist(),
                )
            )

    def _decode_step(self) -> None:
        rows = [r for r in self.active if not r.prefilling]
        if not rows:
            return
        run = self.executor
        try:
            logits = run.decode([r.slot for r in rows], [r.length for r in rows], [r.next_id for r in rows])
        except Exception:
            # One bad row must not end its batch mates: run each row alone, fail only those
            # that fail alone (numerics of this one step are then those of a batch of one).
            log.exception("batched decode failed; retrying its %d rows one by one", len(rows))
            run.drop_batch()
            for r in rows:
                try:
                    logits = run.decode([r.slot], [r.length], [r.next_id])
                except Exception as e:
                    run.drop_batch()
                    self._fail(r, e)
                    continue
                self._decoded([r], logits)
            return
        self._decoded(rows, logits)

    def _decoded(self, rows: list[GenRequest], logits) -> None:
        for r in rows:
            r.length += 1
        self.counters.decode_steps += 1
        self.counters.decode_rows += len(rows)
        self._emit_step(rows, logits)

    def _emit_step(self, rows: list[GenRequest], logits) -> None:
        from .executor import select

        k = max(r.logprobs for r in rows)
        if self.fault is not None:
            logits = self.fault.remap_rows(rows, logits)
        out = select(logits, k, [r.temperature for r in rows], [r.generator for r in rows])
        if any(r.forced for r in rows):
            self._force(rows, logits, out)
        events = []
        for i, r in enumerate(rows):
            if out.errors[i] is not None:  # this row's sampling failed; the others stand
                self._fail(r, out.errors[i], logged=True)
                continue
            events.append((r, self._token_event(r, out, i)))
        self._deliver(events)

    @staticmethod
    def _force(rows: list[GenRequest], logits, out) -> None:
        """Teacher forcing: a row with forced ids left takes the next one as its token (its logprob
        and logit from the same float32 log-softmax select computes); the top-k stays the model's."""
        import torch

        lp = None
        for i, r in enumerate(rows):
            if r.generated < len(r.forced):
                if lp is None:
                    lp = torch.log_softmax(logits.float(), dim=-1)
                tok = r.forced[r.generated]
                out.chosen[i] = tok
                out.chosen_logprob[i] = lp[i, tok]
                out.chosen_logit[i] = logits[i, tok].float()

    def _token_event(self, r: GenRequest, out, i: int) -> TokenEvent:
        """Advance r by its chosen token; end it on EOS or length."""
        tok = int(out.chosen[i])
        r.next_id, r.generated = tok, r.generated + 1
        self.counters.generation_tokens += 1
        reason = None
        if tok in self.executor.eos_ids and not r.ignore_eos and r.generated >= len(r.forced):
            reason = "stop"
        elif r.generated >= r.max_tokens or r.length >= self.executor.max_context:  # no room to feed it
            reason = "length"
        if self.fault is not None:
            reason = self.fault.finish(r, tok, reason)
        if reason:
            self._release(r)
            self.counters.finished[reason] += 1
        n = r.logprobs
        ev = TokenEvent(
            tok,
            float(out.chosen_logprob[i]),
            float(out.chosen_logit[i]),
            out.top_ids[i, :n].tolist(),
            out.top_logprobs[i, :n].tolist(),
            out.top_logits[i, :n].tolist(),
            reason,
        )
        return ev if self.fault is None else self.fault.report(r, ev)

    def _deliver(self, events: list) -> None:
        if self.post is None:
            for r, ev in events:
                r.emit(ev)
        else:  # one wake-up of the consumer's event loop per step, not one per row
            self.post(lambda: [r.emit(ev) for r, ev in events])
