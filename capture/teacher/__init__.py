"""Teacher-forced cache-history diagnostic: replay a request's exact tokens
through an HF causal LM under several KV-cache histories and dtypes, and write
the logits in the trace format (source "teacher_forced").

`run_from_options(...)` is what `tracekit capture --teacher-forced MODEL_DIR` calls
(the CLI prints its summary; this package writes only progress, on stderr). The
library entry points are `run_diagnostic` (sequences -> trace file) and
`trie.run_histories` (one batch -> logits). torch is imported lazily.
"""

from __future__ import annotations

import sys

from tracekit.errors import ConfigError
from tracekit.modelinfo import eos_token_ids

from ..prompts import Prompt, load_prompts
from . import tp as tp_mod
from .diagnostic import DiagnosticConfig, DiagnosticSummary, check_full_logits_size, full_logits_bytes, run_diagnostic
from .history import History, HistorySpec, parse_dtypes, parse_histories
from .model import ATTNS
from .sequences import TokenSequence, from_trace

__all__ = [
    "DiagnosticConfig",
    "DiagnosticSummary",
    "History",
    "HistorySpec",
    "TokenSequence",
    "run_from_options",
    "parse_histories",
    "parse_dtypes",
    "run_diagnostic",
]


def _vocab_size(model_dir: str) -> int:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{model_dir}: not an HF model directory ({first})") from None
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    return int(text.vocab_size)


def run_from_options(
    *,
    teacher_forced: str,
    out: str | None,
    history: str = "full",
    dtype: str = "fp32",
    from_path: str | None = None,
    keys: str | None = None,
    prompts: str | None = None,
    max_tokens: int | None = None,
    attn: str = "auto",
    device: str = "cpu",
    top_logprobs: int = 20,
    full_logits: bool = False,
    force: bool = False,
    no_cuda_graphs: bool = False,
    tp: int = 1,
    tp_backend: str | None = None,
) -> DiagnosticSummary:
    """Run the diagnostic from CLI options (strings as typed); raises ConfigError on bad input.
    `max_tokens` applies to every prompt of `prompts` (their own `max_tokens` fields are
    HTTP-capture overrides; a note on stderr says when they differ). `tp` > 1 runs it under
    transformers' tensor-parallel plan in tp processes that this call starts (tp.py)."""
    opts = dict(locals())  # the options as given, for the TP ranks
    if not out:
        raise ConfigError("--teacher-forced needs --out FILE.h5")
    if (from_path is None) == (prompts is None):
        raise ConfigError("--teacher-forced needs exactly one of --from TRACE or --prompts FILE")
    if keys and from_path is None:
        raise ConfigError("--keys selects requests of --from TRACE; with --prompts, edit the prompt file instead")
    if prompts is not None and not (max_tokens and max_tokens > 0):
        raise ConfigError("--prompts needs --max-tokens N (N >= 1): the number of tokens to generate greedily")
    if attn not in ATTNS:
        raise ConfigError(f"--attn {attn!r}: expected one of {', '.join(ATTNS)}")
    if top_logprobs < 1:
        raise ConfigError(f"--top-logprobs must be >= 1, got {top_logprobs}")
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    if tp_backend and tp == 1:
        raise ConfigError("--tp-backend is the backend of --tp N with N > 1; drop it, or pass --tp")
    if tp > 1 and not tp_mod.in_rank():
        setup = tp_mod.check(teacher_forced, tp, device, tp_backend)
        return tp_mod.launch(setup, {**opts, "tp_backend": setup.backend})
    cfg = DiagnosticConfig(
        model_dir=teacher_forced,
        histories=parse_histories(history),
        dtypes=parse_dtypes(dtype),
        attn=attn,
        device=device,
        topk=top_logprobs,
        full_logits=full_logits,
        force=force,
        cuda_graphs=not no_cuda_graphs,
        tp=tp,
    )
    vocab = _vocab_size(teacher_forced)
    first = None
    if from_path is not None:
        seqs = from_trace(from_path, [k.strip() for k in keys.split(",") if k.strip()] if keys else None)
        extra = {"from": from_path}
    else:
        prompt_list = load_prompts(prompts)
        _note_own_max_tokens(prompt_list, max_tokens)
        if full_logits:  # bound before generating: every sequence at most max_tokens long
            rows = len(prompt_list) * max_tokens * len(cfg.histories) * len(cfg.dtypes)
            check_full_logits_size(rows * vocab * 4, force)
        seqs, first = _generate(cfg, prompt_list, max_tokens)
        extra = {"prompts": prompts, "max_tokens": max_tokens, "generated_in": cfg.dtypes[0]}
    if full_logits:
        check_full_logits_size(full_logits_bytes(seqs, cfg.histories, len(cfg.dtypes), vocab), force)
    return run_diagnostic(cfg, seqs, out, first_model=first, extra_run=extra)


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
    from .model import load_model
    from .sequences import greedy_sequences

    lm = load_model(cfg.model_dir, cfg.dtypes[0], cfg.device, cfg.attn, cfg.cuda_graphs, cfg.tp)
    tokenizer = None
    if any(isinstance(p.prompt, str) for p in prompt_list):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{cfg.model_dir}: text prompts need a tokenizer in the model directory ({e})") from None
    return greedy_sequences(lm, prompt_list, tokenizer, max_tokens, eos_token_ids(cfg.model_dir)), lm
