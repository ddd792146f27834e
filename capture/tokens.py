"""Map token strings to ids with the model's tokenizer, for engines that return
strings only (OpenAI, llama-cpp-python).

Engines return decoded text (" if") while a byte-level BPE vocab stores "Ġif"
and a SentencePiece vocab "▁if" (and "<0x0A>" for a byte it has no piece for).
A string is tried as-is, then in byte-level form, then in SentencePiece form,
then as a byte-fallback piece; `bytes`, when the engine sends them, are used
instead of the string. A string that maps to nothing becomes -1 (unknown, never
a guess). Equal strings of different tokens cannot be told apart: that is a
limit of those engines, not of this mapping. The vocabulary comes from
`tokenizers` (the file's own parser); EOS ids from tracekit/modelinfo.py.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tracekit.errors import ConfigError


@lru_cache(maxsize=1)
def _byte_map() -> dict[int, str]:
    # GPT-2's bytes_to_unicode, the byte-level alphabet: printable bytes map to themselves,
    # the rest to U+0100... (`tokenizers` applies it but does not expose the table).
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def load_vocab(tokenizer_dir: str | Path) -> dict[str, int]:
    """token string -> id, added tokens included, read with `tokenizers`."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own Exception subclass for a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{path}: cannot read a tokenizer ({first}); pass --tokenizer DIR with a Hugging Face tokenizer.json"
        ) from None


class TokenMapper:
    """Callable: list of str|bytes -> list of ids (-1 unknown). Counts misses."""

    def __init__(self, tokenizer_dir: str | Path):
        self.dir = Path(tokenizer_dir)
        self.vocab = load_vocab(self.dir)
        self.misses = 0
        self.mapped = 0

    def one(self, s: str | bytes) -> int:
        v = self.vocab
        if isinstance(s, str):
            hit = v.get(s)
            if hit is not None:
                return hit
            raw = s.encode("utf-8")
        else:
            raw = bytes(s)
        bm = _byte_map()
        hit = v.get("".join(bm[b] for b in raw))
        if hit is None:
            text = raw.decode("utf-8", "replace") if not isinstance(s, str) else s
            hit = v.get(text.replace(" ", "\u2581"))
        if hit is None and len(raw) == 1:
            hit = v.get(f"<0x{raw[0]:02X}>")
        if hit is None:
            self.misses += 1
            return -1
        return hit

    def __call__(self, strs: list) -> list[int]:
        self.mapped += len(strs)
        return [self.one(s) for s in strs]
