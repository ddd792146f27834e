"""The token sequences the diagnostic replays: from a trace, or greedy from prompts.

A TokenSequence is the prompt ids plus the generated ids of one request, with what
the output row should carry over from the source (key, prompt hash, finish
reason, the engine's reported cached_tokens for prefix:auto).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tracekit.errors import ConfigError
from tracekit.schema import prompt_hash as _prompt_hash

from ..prompts import Prompt


@dataclass(frozen=True)
class TokenSequence:
    key: str
    prompt_ids: np.ndarray  # [P] int64
    gen_ids: np.ndarray  # [G] int64, the teacher-forced tokens
    prompt_hash: str
    cached_tokens: int = -1  # the engine's reused prefix (-1 = not reported)
    finish_reason: str = ""
    prompt_text: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.prompt_ids), len(self.gen_ids)


def _note(msg: str) -> None:
    print(msg, file=sys.stderr)


def from_trace(path: str, keys: list[str] | None = None) -> list[TokenSequence]:
    """Sequences of the ok requests of a trace (the last row of each key), in file order."""
    from tracekit.store import TraceReader

    with TraceReader(path) as r:
        table = r.requests
        rows = table.index_by_key()
        if keys:
            missing = [k for k in keys if k not in rows]
            if missing:
                raise ConfigError(
                    f"{path}: no request with key {', '.join(map(repr, missing[:5]))} "
                    f"({len(missing)} missing; the trace has {len(rows)} keys)"
                )
            rows = {k: rows[k] for k in keys}
        out, skipped = [], 0
        for key, i in sorted(rows.items(), key=lambda kv: kv[1]):
            pids = r.prompt_ids(i)
            toks = r.tokens(i).token_id
            if table.status[i] != "ok" or pids is None or len(pids) == 0 or len(toks) == 0:
                skipped += 1
                continue
            out.append(
                TokenSequence(
                    key,
                    np.asarray(pids, np.int64),
                    np.asarray(toks, np.int64),
                    table.prompt_hash[i],
                    int(table.cached_tokens[i]),
                    table.finish_reason[i],
                    table.prompt_text[i],
                )
            )
    if skipped:
        _note(
            f"note: skipped {skipped} request(s) of {path} that failed, have no prompt token ids or no generated tokens"
        )
    if not out:
        raise ConfigError(f"{path}: no replayable request (status ok, prompt token ids and >= 1 generated token)")
    return out


def greedy_sequences(
    lm, prompts: list[Prompt], tokenizer, max_tokens: int, eos_ids: tuple[int, ...]
) -> list[TokenSequence]:
    """Greedy-decode each prompt (one at a time, prefill then decode on a KV
    cache, as serving does), stopping after an EOS id or max_tokens."""
    import torch

    from tracekit.hfcompat import new_dynamic_cache

    out = []
    for pid, prompt in ((p.id, p.prompt) for p in prompts):
        # No special tokens added, as `tracekit serve` encodes text prompts.
        ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise ConfigError(f"prompt {pid!r}: tokenizes to no tokens")
        if max(ids) >= lm.vocab_size or min(ids) < 0:
            raise ConfigError(f"prompt {pid!r}: token id out of range for a vocabulary of {lm.vocab_size}")
        cache, gen, x = new_dynamic_cache(lm.model), [], torch.tensor([ids], device=lm.device)
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = lm.model(input_ids=x, use_cache=True, logits_to_keep=1, **{lm.cache_kw: cache}).logits
                nxt = int(logits[0, -1].argmax())
                gen.append(nxt)
                if nxt in eos_ids:
                    break
                x = torch.tensor([[nxt]], device=lm.device)
        reason = "stop" if gen[-1] in eos_ids else "length"
        out.append(
            TokenSequence(
                pid,
                np.asarray(ids, np.int64),
                np.asarray(gen, np.int64),
                _prompt_hash(prompt),
                -1,
                reason,
                prompt if isinstance(prompt, str) else "",
            )
        )
    return out
