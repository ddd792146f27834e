"""Injected engine faults (TESTING ONLY): bugs tracekit must catch, on purpose.

Each kind imitates a real serving-engine bug (the thread it is modelled on is
named in SPECS and in docs/engine.md) and takes a magnitude, `kind:MAG`, with a
documented default; magnitude 0 runs the same code and is bitwise the healthy
engine (tested). Every decision a fault takes is deterministic: a probability
knob P is compared against a hash of what the affected row itself holds (its
token and position, never the clock or the batch order), so the same request
meets the same fault in every run.

The two original kinds act on the blocks a prefix-cache hit serves (never on
what is stored, so the cache itself stays healthy and the fault repeats on
every hit):

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

The family (faults_hooks.py holds their code; this module only names and parses
them): batched-path numerics (`batch-scale`), padding (`open-pad-column`), KV
written to the wrong row (`kv-row-swap`), prefix-cache keys and ownership
(`prefix-key-collision`, `prefix-use-after-free`), positions (`hit-position-offset`,
`chunk-boundary`), reporting (`topk-misorder`, `stale-logprobs`,
`cached-tokens-off`), lifecycle (`early-stop`) and row routing
(`wrong-row-sample`). See SPECS for each one's knob, default, hook and model.

Each prefix-cache application of the original two is logged (`FaultLog`): how
many KV values it actually changed. In BF16 a small EPS rounds back to the same
value for most or all elements, so "the request hit the cache" is not "the
request was corrupted".
"""

from __future__ import annotations

import collections
import hashlib
import math
import threading
from dataclasses import dataclass

from ..errors import ConfigError
from .kvblock import Block

NOISE_SEED = 0x7472616365  # mixed into every block's noise seed ("trace")


@dataclass(frozen=True)
class Spec:
    """One fault kind: its knob (None = takes no magnitude), default, where it hooks, what it models."""

    kind: str
    knob: str | None  # EPS (float >= 0), P (probability), N / K (int >= 0)
    default: float | None  # None: the knob must be given
    needs: str  # "prefix_cache" | "prefill_chunk" | "" (what the engine must have on)
    hook: str
    models: str


SPECS = {
    s.kind: s
    for s in (
        Spec("corrupt-prefix-cache", None, None, "prefix_cache", "prefix_cache.lookup", "block ownership"),
        Spec("perturb-kv", "EPS", None, "prefix_cache", "prefix_cache.lookup", "graded KV corruption"),
        Spec(
            "batch-scale",
            "EPS",
            1e-3,
            "",
            "executor.decode (B > 1)",
            "ggml-org/llama.cpp#24962, #6173: batched decode kernel numerics differ only above a batch shape",
        ),
        Spec(
            "open-pad-column",
            "N",
            1,
            "",
            "executor._build_batch",
            "ml-explore/mlx-lm#1906, IBM/vllm#64: left-padding mask not applied in batched decode",
        ),
        Spec(
            "kv-row-swap",
            "P",
            0.1,
            "",
            "executor.decode (after the forward)",
            "ggml-org/llama.cpp#28537, vllm-project/vllm#36580: KV written to a batch mate's slot",
        ),
        Spec(
            "prefix-key-collision",
            "N",
            4,
            "prefix_cache",
            "prefix_cache.chain_keys",
            "vllm-project/vllm#12621, openvinotoolkit/openvino.genai#3722: a hash collision serves another prompt's KV",
        ),
        Spec(
            "prefix-use-after-free",
            "N",
            16,
            "prefix_cache",
            "prefix_cache.lookup / insert",
            "sgl-project/mini-sglang#142: a hit's pages freed and handed to the next insert",
        ),
        Spec(
            "hit-position-offset",
            "K",
            1,
            "prefix_cache",
            "engine._prefill_one -> executor.prefill",
            "waybarrios/vllm-mlx#311, vllm-project/vllm-metal#144: RoPE offset wrong after a prefix hit",
        ),
        Spec(
            "chunk-boundary",
            "K",
            1,
            "prefill_chunk",
            "engine._prefill_one (continuation chunk)",
            "vllm-project/vllm#7380, #10388: chunked-prefill boundary loses KV / positions",
        ),
        Spec(
            "topk-misorder",
            "P",
            1.0,
            "",
            "engine._token_event",
            "abetlen/llama-cpp-python#453: top logprobs indexed after sorting",
        ),
        Spec(
            "stale-logprobs",
            "P",
            1.0,
            "",
            "engine._token_event",
            "sgl-project/sglang#39260 (#39261): streamed top_logprobs of another token",
        ),
        Spec(
            "cached-tokens-off",
            "K",
            1,
            "prefix_cache",
            "engine._load_prefix (reported only)",
            "vllm-project/vllm-ascend#8910 (#11630): cached_tokens misreported by one",
        ),
        Spec(
            "early-stop",
            "P",
            0.05,
            "",
            "engine._token_event",
            "vllm-project/vllm#4589: stop token ids honoured despite ignore_eos",
        ),
        Spec(
            "wrong-row-sample",
            "P",
            0.05,
            "",
            "engine._emit_step (B > 1)",
            "ggml-org/llama.cpp#10072, #4194: a slot's token from another slot's logits",
        ),
    )
}
PREFIX_KV_KINDS = ("corrupt-prefix-cache", "perturb-kv")  # apply_fault below: blocks served by a hit
KINDS = tuple(s.kind if s.knob is None else f"{s.kind}:{s.knob}" for s in SPECS.values())
INT_KNOBS = ("N", "K")


@dataclass(frozen=True)
class Fault:
    kind: str  # a key of SPECS
    eps: float = 0.0  # the magnitude (EPS, P, N or K; the historical name of the field)

    @property
    def mag(self) -> float:
        return self.eps

    @property
    def spec(self) -> Spec:
        return SPECS[self.kind]

    @property
    def name(self) -> str:
        """The canonical spelling, as /v1/models meta.inject_fault reports it."""
        knob = self.spec.knob
        if knob is None:
            return self.kind
        return f"{self.kind}:{int(self.eps)}" if knob in INT_KNOBS else f"{self.kind}:{self.eps!r}"


def parse_fault(text: str | None) -> Fault | None:
    """`KIND` or `KIND:MAG` (see SPECS) -> Fault; None -> None. Errors name the valid spellings."""
    if text is None:
        return None
    name, sep, arg = text.strip().partition(":")
    spec = SPECS.get(name)
    if spec is None:
        raise ConfigError(f"--inject-fault {text!r}: expected one of {', '.join(KINDS)}")
    if spec.knob is None:
        if sep:
            raise ConfigError(f"--inject-fault {text!r}: {name} takes no magnitude (one of {', '.join(KINDS)})")
        return Fault(name)
    if not sep:
        if spec.default is None:
            raise ConfigError(f"--inject-fault {text!r}: {name} needs {spec.knob}, e.g. {name}:0.01")
        return Fault(name, float(spec.default))
    return Fault(name, _magnitude(text, spec, arg))


def _magnitude(text: str, spec: Spec, arg: str) -> float:
    try:
        mag = float(arg)
    except ValueError:
        mag = math.nan
    ok = math.isfinite(mag) and mag >= 0
    if spec.knob == "P":
        ok = ok and mag <= 1
    if spec.knob in INT_KNOBS:
        ok = ok and mag == int(mag)
    if not ok:
        what = {"EPS": "a finite number >= 0", "P": "a probability in [0, 1]"}.get(spec.knob, "an integer >= 0")
        raise ConfigError(
            f"--inject-fault {text!r}: {spec.knob} must be {what}, e.g. {spec.kind}:{spec.default or 0.01}"
        )
    return mag


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
