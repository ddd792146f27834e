"""Teacher-forced cache-history diagnostic: replay a request's exact tokens
through an HF causal LM under several KV-cache histories and dtypes, and write
the logits in the trace format (source "teacher_forced").

`cli_run(**opts)` is what `tracekit capture --teacher-forced MODEL_DIR` calls.
The library entry points are `run_diagnostic` (sequences -> trace file) and
`runner.run_histories` (one batch -> logits). torch is imported lazily.
"""

from __future__ import annotations

from tracekit.errors import ConfigError

from .diagnostic import DiagnosticConfig, DiagnosticSummary, check_full_logits_size, full_logits_bytes, run_diagnostic
from .history import History, HistorySpec, parse_dtypes, parse_histories
from .model import ATTNS
from .sequences import TokenSequence, from_trace, read_prompts

__all__ = [
    "DiagnosticConfig",
    "DiagnosticSummary",
    "History",
    "HistorySpec",
    "TokenSequence",
    "cli_run",
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


def cli_run(*, as_json: bool = False, **opts) -> int:
    """`tracekit capture --teacher-forced`: run, print a summary on stdout
    (one JSON document with --json), return the exit code (0)."""
    import json
    import sys

    s = run_from_options(**opts)
    if as_json:
        print(json.dumps(s.as_dict(), sort_keys=True))
    else:
        print(
            f"{s.path}: {s.rows} teacher-forced rows ({s.sequences} sequences x histories x dtypes); "
            + ", ".join(f"{d} {t:.1f}s" for d, t in s.seconds_by_dtype.items())
        )
    if s.skipped:
        print(
            f"note: {len(s.skipped)} (sequence, history) pairs did not apply and have no row: "
            + ", ".join(s.skipped[:5])
            + (" ..." if len(s.skipped) > 5 else ""),
            file=sys.stderr,
        )
    return 0


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
    **_ignored,
) -> DiagnosticSummary:
    """Run the diagnostic from CLI options (strings as typed); raises ConfigError on bad input.
    Options of the HTTP capture that do not apply here arrive in **_ignored."""
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
    )
    vocab = _vocab_size(teacher_forced)
    first = None
    if from_path is not None:
        seqs = from_trace(from_path, [k.strip() for k in keys.split(",") if k.strip()] if keys else None)
        extra = {"from": from_path}
    else:
        prompt_list = read_prompts(prompts)
        if full_logits:  # bound before generating: every sequence at most max_tokens long
            rows = len(prompt_list) * max_tokens * len(cfg.histories) * len(cfg.dtypes)
            check_full_logits_size(rows * vocab * 4, force)
        seqs, first = _generate(cfg, prompt_list, max_tokens)
        extra = {"prompts": prompts, "max_tokens": max_tokens, "generated_in": cfg.dtypes[0]}
    if full_logits:
        check_full_logits_size(full_logits_bytes(seqs, cfg.histories, len(cfg.dtypes), vocab), force)
    return run_diagnostic(cfg, seqs, out, first_model=first, extra_run=extra)


def _generate(cfg: DiagnosticConfig, prompt_list, max_tokens: int):
    """Greedy sequences in the first asked dtype; returns them and the loaded model."""
    from .model import load_model
    from .sequences import eos_token_ids, greedy_sequences

    lm = load_model(cfg.model_dir, cfg.dtypes[0], cfg.device, cfg.attn, cfg.cuda_graphs)
    tokenizer = None
    if any(isinstance(p, str) for _, p in prompt_list):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{cfg.model_dir}: text prompts need a tokenizer in the model directory ({e})") from None
    return greedy_sequences(lm, prompt_list, tokenizer, max_tokens, eos_token_ids(lm.model)), lm
