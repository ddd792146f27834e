"""`TeacherConfig`: the options of `tracekit capture --teacher-forced MODEL_DIR`, as typed.

The CLI builds one and calls `run.run_teacher`; the TP launcher hands the same record, as JSON,
to every rank it starts. This module only checks the options against each other; what needs the
model directory or torch (the vocabulary, the TP plan, the devices) is checked where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracekit.errors import ConfigError

from .model import ATTNS


def hf_config(model_dir: str):
    """(the model directory's HF config, its text config) or a ConfigError that names the directory."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{model_dir}: not an HF model directory ({first})") from None
    return cfg, getattr(cfg, "get_text_config", lambda: cfg)()


@dataclass(frozen=True)
class TeacherConfig:
    """One teacher-forced run. Strings are the command line's (`history="full,decode"`,
    `dtype="fp32,bf16"`); exactly one of `from_path` and `prompts` names the sequences."""

    model_dir: str  # --teacher-forced MODEL_DIR
    out: str | None  # --out FILE.h5
    history: str = "full"
    dtype: str = "fp32"
    from_path: str | None = None  # --from TRACE
    keys: str | None = None  # K,... of --from
    prompts: str | None = None
    max_tokens: int | None = None  # every prompt's greedy length (the prompt file's own is not used)
    attn: str = "auto"
    device: str = "cpu"
    top_logprobs: int = 20
    full_logits: bool = False
    force: bool = False
    no_cuda_graphs: bool = False
    no_prefix_reuse: bool = False  # run every first segment itself (reuse.py: only ever a cost saving)
    tp: int = 1  # > 1: tp ranks under transformers' tensor-parallel plan (tp.py)
    tp_backend: str | None = None  # gloo | nccl; None: the device's default (tp.check)

    def check(self) -> None:
        """The options against each other; raises ConfigError naming the flag to change."""
        if not self.out:
            raise ConfigError("--teacher-forced needs --out FILE.h5")
        if (self.from_path is None) == (self.prompts is None):
            raise ConfigError("--teacher-forced needs exactly one of --from TRACE or --prompts FILE")
        if self.keys and self.from_path is None:
            raise ConfigError("--keys selects requests of --from TRACE; with --prompts, edit the prompt file instead")
        if self.prompts is not None and not (self.max_tokens and self.max_tokens > 0):
            raise ConfigError("--prompts needs --max-tokens N (N >= 1): the number of tokens to generate greedily")
        if self.attn not in ATTNS:
            raise ConfigError(f"--attn {self.attn!r}: expected one of {', '.join(ATTNS)}")
        if self.top_logprobs < 1:
            raise ConfigError(f"--top-logprobs must be >= 1, got {self.top_logprobs}")
        if self.tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {self.tp}")
        if self.tp_backend and self.tp == 1:
            raise ConfigError("--tp-backend is the backend of --tp N with N > 1; drop it, or pass --tp")
