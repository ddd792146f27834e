"""Map token strings to ids with the model's tokenizer, for engines that
return strings only (OpenAI, llama-cpp-python). Also reads EOS ids.

Engines return decoded text (" if") while a byte-level BPE vocab stores
"Ġif"; strings are tried as-is, then in byte-level form, then in
SentencePiece form ("▁if"). A string that maps to nothing becomes -1 (and the
run metadata says how many did). Equal strings of different tokens cannot be
told apart: that is a limit of those engines, not of this mapping.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Callable

from tracekit.errors import ConfigError


@lru_cache(maxsize=1)
def _byte_map() -> dict[int, str]:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100...
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenMapper:
    """Callable: list of str|bytes -> list of ids (-1 unknown). Counts misses."""

    def __init__(self, tokenizer_dir: str | Path):
        self.dir = Path(tokenizer_dir)
        path = self.dir / "tokenizer.json"
        try:
            vocab = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
            added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
        except (OSError, KeyError, ValueError) as e:
            raise ConfigError(
                f"{path}: cannot read a tokenizer vocabulary ({e}); pass --tokenizer DIR "
                "with a Hugging Face tokenizer.json"
            ) from None
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
            vocab = {p[0]: i for i, p in enumerate(vocab)}
        self.vocab: dict[str, int] = dict(vocab)
        for a in added:
            self.vocab.setdefault(a["content"], a["id"])
        self.misses = 0
        self.mapped = 0

    def one(self, s: str | bytes) -> int:
        if isinstance(s, str):
            hit = self.vocab.get(s)
            if hit is not None:
                return hit
            raw = s.encode("utf-8")
        else:
            raw = s
        bm = _byte_map()
        hit = self.vocab.get("".join(bm[b] for b in raw))
        if hit is None and isinstance(s, str):
            hit = self.vocab.get(s.replace(" ", "\u2581"))
        if hit is None:
            self.misses += 1
            return -1
        return hit

    def __call__(self, strs: list) -> list[int]:
        self.mapped += len(strs)
        return [self.one(s) for s in strs]

    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json / config.json, else tokenizer_config.json's eos_token."""
        for name in ("generation_config.json", "config.json"):
            p = self.dir / name
            if p.exists():
                eos = json.loads(p.read_text()).get("eos_token_id")
                if eos is not None:
                    return sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
        p = self.dir / "tokenizer_config.json"
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str) and eos in self.vocab:
                return [self.vocab[eos]]
        return []


def load_mapper(tokenizer_dir: str | None) -> Callable | None:
    return TokenMapper(tokenizer_dir) if tokenizer_dir else None
