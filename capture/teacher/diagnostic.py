"""The diagnostic end to end: sequences x histories x dtypes -> one trace file.

For each dtype the model is loaded once; sequences with the same prompt and
output lengths and the same resolved histories go through together, in
batches of at most `batch_tokens` input tokens, and each batch runs its
histories as one trie (trie.run_histories). Rows are written one per
(sequence, history, dtype) and flushed after each batch.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from tracekit.errors import ConfigError
from tracekit.modelinfo import eos_token_ids
from tracekit.runinfo import base_run
from tracekit.schema import Layout, RequestRecord, RunMeta

from . import reuse
from .history import History, HistorySpec
from .model import load_model, resolve_attn
from .records import DiagnosticSummary, Rank
from .sequences import TokenSequence
from .trie import run_histories

FULL_LOGITS_LIMIT_BYTES = 10**9


@dataclass(frozen=True)
class DiagnosticConfig:
    model_dir: str
    histories: tuple[HistorySpec, ...]
    dtypes: tuple[str, ...]
    attn: str = "auto"  # sdpa_lower_right on CUDA, sdpa on CPU
    device: str = "cpu"
    topk: int = 20
    full_logits: bool = False
    force: bool = False
    cuda_graphs: bool = True  # decode chains on CUDA as graphs with eager attention (graphs.py)
    # cut a first segment [0, b) from a sibling's longer [0, S) where verified bitwise for the shape
    # (reuse.py); never under TP. The logits are the same either way.
    reuse_prefixes: bool = True
    batch_tokens: int = 1 << 15  # input tokens per batched forward (memory bound)
    batch_logits_bytes: int = 1 << 29  # FP32 bytes of one history's scored logits [N, G, V] per batch
    rank: Rank | None = None  # this process's rank of a --tp run (only inside the ranks tp.launch starts)
    # key -> the histories of that sequence alone (`histories` is then what the run may hold, the
    # run metadata's list); a key not in it gets `histories`. explain replays each pair's own
    # boundaries, not every pair's for every pair.
    histories_by_key: dict | None = None

    @property
    def tp(self) -> int:
        """The tensor-parallel size: 1 without a rank."""
        return self.rank.world if self.rank is not None else 1


def resolve(seq: TokenSequence, specs: tuple[HistorySpec, ...]) -> tuple[list[History], list[str]]:
    """The sequence's histories (duplicates by label dropped) and the specs that do not apply."""
    out, skipped = [], []
    p, g = seq.shape
    for spec in specs:
        h = spec.resolve(p, g, seq.cached_tokens)
        if h is None:
            skipped.append(f"{spec.label} ({spec.why_not(p, g, seq.cached_tokens)})")
        elif h.label not in {x.label for x in out}:
            out.append(h)
    return out, skipped


class _NoWriter:
    """The trace writer of a TP rank other than 0: every rank computes every row, rank 0 writes them."""

    def append(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def plan_batches(
    seqs: list[TokenSequence],
    specs: tuple[HistorySpec, ...],
    batch_tokens: int,
    logits_per_seq_bytes=lambda g: 0,
    logits_budget: int = 1 << 29,
    by_key: dict | None = None,
):
    """Batches [(seq indices, histories)]: equal shapes and equal histories, at
    most batch_tokens inputs and logits_budget bytes of one history's scored
    logits each. `by_key`: a sequence's own specs by key, instead of `specs`.
    Also returns the skipped 'key history' pairs."""
    groups: dict[tuple, list[int]] = {}
    hist_of: dict[tuple, list[History]] = {}
    skipped = []
    for i, s in enumerate(seqs):
        hists, bad = resolve(s, by_key.get(s.key, specs) if by_key else specs)
        skipped += [f"{s.key} {label}" for label in bad]
        if not hists:
            continue
        gk = (s.shape, tuple((h.label, h.ends) for h in hists))
        groups.setdefault(gk, []).append(i)
        hist_of[gk] = hists
    batches = []
    for gk, idx in groups.items():
        by_logits = logits_budget // max(1, logits_per_seq_bytes(gk[0][1]))
        per = max(1, min(batch_tokens // max(1, sum(gk[0]) - 1), by_logits))
        batches += [(idx[j : j + per], hist_of[gk]) for j in range(0, len(idx), per)]
    return batches, skipped


def full_logits_bytes(seqs: list[TokenSequence], specs, n_dtypes: int, vocab: int) -> int:
    """Uncompressed FP32 size of the full-logits column the run would write."""
    rows = sum(len(resolve(s, specs)[0]) * len(s.gen_ids) for s in seqs)
    return rows * n_dtypes * vocab * 4


def check_full_logits_size(nbytes: int, force: bool) -> None:
    if nbytes > FULL_LOGITS_LIMIT_BYTES and not force:
        raise ConfigError(
            f"--full-logits would write {nbytes / 1e9:.2f} GB of FP32 logits (before compression), "
            f"over the {FULL_LOGITS_LIMIT_BYTES / 1e9:.0f} GB limit; pass --force to write them "
            "anyway, or drop --full-logits (top-k raw logits are always stored)"
        )


def run_meta(cfg: DiagnosticConfig, vocab: int, eos: tuple[int, ...], extra: dict) -> RunMeta:
    import torch
    import transformers

    run = base_run(
        model=cfg.model_dir,
        histories=[s.label for s in cfg.histories],
        dtypes=list(cfg.dtypes),
        attn=resolve_attn(cfg.attn, cfg.device),
        device=cfg.device,
        top_logprobs=cfg.topk,
        full_logits=cfg.full_logits,
        # never cpu, never a device_map, never under TP
        cuda_graphs=cfg.cuda_graphs and cfg.device.startswith("cuda") and cfg.tp == 1,
        prefix_reuse=cfg.reuse_prefixes and cfg.tp == 1,
        tp=cfg.tp,
        **_tp_run(cfg),
        eos_token_ids=list(eos),
        torch=torch.__version__,
        transformers=transformers.__version__,
        **extra,
    )
    return RunMeta(
        source="teacher_forced",
        run=run,
        layout=Layout(topk=cfg.topk, raw_logits=True, vocab_size=vocab if cfg.full_logits else 0),
    )


def _tp_run(cfg: DiagnosticConfig) -> dict:
    """Run metadata of a TP run: backend, each rank's device, and torch's threads a rank (CPU)."""
    if cfg.rank is None:
        return {}
    import torch

    r = cfg.rank
    return {"tp_backend": r.backend, "tp_devices": list(r.devices), "torch_threads": torch.get_num_threads()}


def write_rows(writer, cfg: DiagnosticConfig, lm, seqs: list[TokenSequence], batches) -> int:
    """Run every batch in one loaded dtype and append its rows; returns rows written."""
    import torch

    from .scoring import score

    rows = 0
    for idx, hists in batches:
        batch = [seqs[i] for i in idx]
        p, g = batch[0].shape
        full = torch.from_numpy(np.stack([np.concatenate([s.prompt_ids, s.gen_ids]) for s in batch]))
        full = full.to(lm.device)  # [N, P+G]
        logits = run_histories(lm, full[:, :-1], p - 1, hists)
        targets = full[:, p:]  # [N, G]
        cols = {h.label: score(logits[h.label], targets, cfg.topk, cfg.full_logits) for h in hists}
        for n, s in enumerate(batch):
            for h in hists:
                rec = RequestRecord(
                    key=s.key,
                    prompt_hash=s.prompt_hash,
                    finish_reason=s.finish_reason,
                    cached_tokens=h.cached_tokens,
                    prompt_len=p,
                    history=h.label,
                    dtype=lm.dtype,
                    prompt_text=s.prompt_text,
                    params=json.dumps({"teacher_forced": True, "tp": cfg.tp}),
                )
                writer.append(rec, cols[h.label][n], s.prompt_ids, flush=False)
                rows += 1
        writer.flush()
        del logits, cols
    return rows


def run_diagnostic(
    cfg: DiagnosticConfig, seqs: list[TokenSequence], out: str, first_model=None, extra_run: dict | None = None
) -> DiagnosticSummary:
    """Write the diagnostic trace for `seqs` to `out`. first_model: an already
    loaded LoadedModel in cfg.dtypes[0] (the greedy generator's), reused."""
    from tracekit.store import TraceWriter

    summary, writer, batches = None, None, None
    try:
        for d in cfg.dtypes:
            t0 = time.perf_counter()
            lm = (
                first_model
                if first_model is not None and first_model.dtype == d
                else load_model(cfg.model_dir, d, cfg.device, cfg.attn, cfg.cuda_graphs, cfg.rank)
            )
            lm = replace(lm, reuse_prefixes=lm.reuse_prefixes and cfg.reuse_prefixes)  # the same verdicts dict
            if batches is None:
                batches, skipped = plan_batches(
                    seqs,
                    cfg.histories,
                    cfg.batch_tokens,
                    lambda g, v=lm.vocab_size: g * v * 4,
                    cfg.batch_logits_bytes,
                    cfg.histories_by_key,
                )
                if not batches:
                    raise ConfigError(
                        "no history applies to any sequence (prefix boundaries unknown, zero or past the end)"
                    )
                summary = DiagnosticSummary(path=out, sequences=len(seqs), skipped=skipped)
            if writer is None:
                # Chunk-size hint (rows x histories x dtypes): a small diagnostic gets a small file.
                hint = sum(len(q.gen_ids) for q in seqs) * len(cfg.histories) * len(cfg.dtypes)
                meta = run_meta(cfg, lm.vocab_size, eos_token_ids(cfg.model_dir), extra_run or {})
                writer = (
                    TraceWriter(out, meta, expected_tokens=hint)
                    if cfg.rank is None or cfg.rank.writes_trace
                    else _NoWriter()
                )
            before = dict(reuse.STATS)
            summary.rows += write_rows(writer, cfg, lm, seqs, batches)
            summary.seconds_by_dtype[d] = round(time.perf_counter() - t0, 3)
            for k in summary.prefix_segments:
                summary.prefix_segments[k] += reuse.STATS[k] - before[k]
            print(
                f"teacher-forced {d}: {summary.rows} rows so far, {summary.seconds_by_dtype[d]:.1f} s; "
                f"first segments cut from a longer one: {reuse.STATS['reused'] - before['reused']}, "
                f"shapes verified: {reuse.STATS['verified'] - before['verified']}",
                file=sys.stderr,
            )
            del lm
    finally:
        if writer is not None:
            writer.close()
    return summary
