"""`run_teacher`: a TeacherConfig -> the diagnostic's trace file and its summary.

What `tracekit capture --teacher-forced MODEL_DIR` calls (the CLI prints the summary; this module
writes only progress, on stderr), in the calling process and again inside each rank of a --tp run
(tp_rank.py), where the launcher passes that rank down explicitly. torch is imported lazily.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from tracekit.errors import ConfigError
from tracekit.modelinfo import eos_token_ids

from ..prompts import Prompt, load_prompts
from . import tp
from .config import TeacherConfig, hf_config
from .diagnostic import DiagnosticConfig, check_full_logits_size, full_logits_bytes, run_diagnostic
from .history import parse_dtypes, parse_histories
from .model import load_model
from .records import DiagnosticSummary, Rank
from .sequences import from_trace, greedy_sequences


def run_teacher(cfg: TeacherConfig, rank: Rank | None = None) -> DiagnosticSummary:
    """Run the diagnostic that `cfg` asks for; raises ConfigError on bad input.

    `cfg.max_tokens` applies to every prompt of `cfg.prompts` (their own `max_tokens` fields are
    HTTP-capture overrides; a note on stderr says when they differ). `cfg.tp` > 1 without a rank
    starts tp processes under transformers' tensor-parallel plan (tp.py) and returns rank 0's
    summary; inside one of them, `rank` says which it is."""
    cfg.check()
    if cfg.tp > 1 and rank is None:
        setup = tp.check(cfg.model_dir, cfg.tp, cfg.device, cfg.tp_backend)
        return tp.launch(setup, replace(cfg, tp_backend=setup.backend))
    dcfg = DiagnosticConfig(
        model_dir=cfg.model_dir,
        histories=parse_histories(cfg.history),
        dtypes=parse_dtypes(cfg.dtype),
        attn=cfg.attn,
        device=cfg.device,
        topk=cfg.top_logprobs,
        full_logits=cfg.full_logits,
        force=cfg.force,
        cuda_graphs=not cfg.no_cuda_graphs,
        reuse_prefixes=not cfg.no_prefix_reuse,
        rank=rank,
    )
    vocab = _vocab_size(cfg.model_dir)
    first = None
    if cfg.from_path is not None:
        keys = [k.strip() for k in cfg.keys.split(",") if k.strip()] if cfg.keys else None
        seqs = from_trace(cfg.from_path, keys)
        extra = {"from": cfg.from_path}
    else:
        prompt_list = load_prompts(cfg.prompts)
        _note_own_max_tokens(prompt_list, cfg.max_tokens)
        if cfg.full_logits:  # bound before generating: every sequence at most max_tokens long
            rows = len(prompt_list) * cfg.max_tokens * len(dcfg.histories) * len(dcfg.dtypes)
            check_full_logits_size(rows * vocab * 4, cfg.force)
        seqs, first = _generate(dcfg, prompt_list, cfg.max_tokens)
        extra = {"prompts": cfg.prompts, "max_tokens": cfg.max_tokens, "generated_in": dcfg.dtypes[0]}
    if cfg.full_logits:
        check_full_logits_size(full_logits_bytes(seqs, dcfg.histories, len(dcfg.dtypes), vocab), cfg.force)
    return run_diagnostic(dcfg, seqs, cfg.out, first_model=first, extra_run=extra)


def _vocab_size(model_dir: str) -> int:
    return int(hf_config(model_dir)[1].vocab_size)


def _note_own_max_tokens(prompt_list: list[Prompt], max_tokens: int) -> None:
    own = sorted({p.overrides["max_tokens"] for p in prompt_list if "max_tokens" in p.overrides} - {max_tokens})
    if own:
        print(
            f"note: --max-tokens {max_tokens} applies to every prompt of the teacher-forced run; "
            f"the prompt file's own max_tokens ({', '.join(map(str, own))}) are not used",
            file=sys.stderr,
        )


def _generate(cfg: DiagnosticConfig, prompt_list: list[Prompt], max_tokens: int):
    """Greedy sequences in the first asked dtype; returns them and the loaded model."""
    lm = load_model(cfg.model_dir, cfg.dtypes[0], cfg.device, cfg.attn, cfg.cuda_graphs, cfg.rank)
    tokenizer = None
    if any(isinstance(p.prompt, str) for p in prompt_list):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{cfg.model_dir}: text prompts need a tokenizer in the model directory ({e})") from None
    return greedy_sequences(lm, prompt_list, tokenizer, max_tokens, eos_token_ids(cfg.model_dir)), lm
