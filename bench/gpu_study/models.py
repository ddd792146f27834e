"""The study's four architectures: real configs, random weights from a fixed seed, peaked LM head.

    python bench/gpu_study/models.py --out /tmp/tkm --models qwen3-0.6b,qwen3-4b [--device cuda] [--smoke]

Each model is built from its published config (values below, copied from the
checkpoints' config.json), initialised by transformers from `torch.manual_seed(SEED)`,
then given a PEAKED next-token distribution: every row of the LM head (the tied
embedding where the config ties them) is scaled by exp(TAU * n), n a standard normal
from its own seeded generator. With the default 0.02 init the logits of all rows
have one scale, so the top two of 150K near-Gaussian logits sit ~0.1 nats apart and
BF16 rounds many to exact ties; log-normal row scales give a heavy-tailed logit
distribution whose top candidate stands out, as a trained model's does. `tie_stats`
measures what a reader needs to judge it: the median top-2 gap and the exact-tie rate
of BF16 logits, before and after the scaling.

A tokenizer the engine can load is written beside the weights: a `tokenizers`
WordLevel model whose vocabulary is exactly the config's (`<t123>` per id, the
config's special ids named), so token-id prompts and decoded outputs round-trip.
The weights are saved in BF16 safetensors (what the checkpoints ship).
`--smoke` shrinks every config (same architecture, a few layers, 4,096 ids) for a
CPU check of the whole path. Nothing here is a trained model: every table says so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SEED = 0
TAU = 0.75  # log-normal sigma of the LM-head row scales (see the module docstring)

# Published configs (the checkpoints' config.json, architecture fields only); weights are random.
CONFIGS = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # google/gemma-3-1b-it: 5 sliding-window layers (window 512) to each full one.
    "gemma3-1b": dict(
        model_type="gemma3_text",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        sliding_window_pattern=6,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        bos_token_id=2,
        eos_token_id=[1, 106],
        pad_token_id=0,
    ),
    # meta-llama/Llama-3.1-8B: the Llama-3 8B shape with its 128K-position rope (context 9,216 fits).
    "llama3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}
SMOKE = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, head_dim=16
)


def config_dict(name: str, smoke: bool = False) -> dict:
    """The config's fields; --smoke keeps the architecture and shrinks it (ids stay < vocab)."""
    c = dict(CONFIGS[name])
    if smoke:
        c.update(SMOKE, num_key_value_heads=min(c["num_key_value_heads"], 2))
        if "query_pre_attn_scalar" in c:
            c.update(query_pre_attn_scalar=16, sliding_window=24)
        for k in ("bos_token_id", "pad_token_id"):
            c.pop(k, None)
        c["eos_token_id"] = 3
    return c


def kv_bytes_per_lane(name: str, context: int, dtype_bytes: int = 2) -> int:
    """layers x KV heads x head dim x 2 (K, V) x context x dtype bytes: one sequence's full KV."""
    c = CONFIGS[name]
    return c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2 * context * dtype_bytes


def _config(name: str, smoke: bool):
    from transformers import AutoConfig

    c = config_dict(name, smoke)
    return AutoConfig.for_model(c.pop("model_type"), **c)


def special_ids(cfg) -> dict[int, str]:
    names = {}
    for field_, label in (("bos_token_id", "<bos>"), ("pad_token_id", "<pad>")):
        v = getattr(cfg, field_, None)
        if isinstance(v, int):
            names[v] = label
    eos = cfg.eos_token_id
    for i, v in enumerate(eos if isinstance(eos, list) else [eos]):
        names[v] = "<eos>" if i == 0 else f"<eos{i}>"
    return names


def write_tokenizer(cfg, out: Path) -> None:
    """A WordLevel tokenizer with exactly cfg.vocab_size ids: `<t{i}>`, special ids named."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = special_ids(cfg)
    vocab = {special.get(i, f"<t{i}>"): i for i in range(cfg.vocab_size)}
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id  # Gemma3: [1, 106]
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special[eos]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kw = {"eos_token": special[eos]}
    if isinstance(getattr(cfg, "bos_token_id", None), int):
        kw["bos_token"] = special[cfg.bos_token_id]
    if isinstance(getattr(cfg, "pad_token_id", None), int):
        kw["pad_token"] = special[cfg.pad_token_id]
    PreTrainedTokenizerFast(tokenizer_object=tok, **kw).save_pretrained(out)


def peak_lm_head(model, seed: int = SEED, tau: float = TAU) -> None:
    """Scale each LM-head row by exp(tau * n), n ~ N(0, 1) from a seeded CPU generator."""
    import torch

    w = model.get_output_embeddings().weight  # [V, hidden]; the embedding itself when tied
    g = torch.Generator().manual_seed(seed + 1)
    scale = torch.exp(tau * torch.randn(w.shape[0], generator=g))
    with torch.no_grad():
        w.mul_(scale.to(w.device, torch.float32)[:, None].to(w.dtype))


def build(name: str, device: str = "cpu", smoke: bool = False, peaked: bool = True, dtype: str = "bf16"):
    """The model in `dtype` on `device` (initialised there: a 4B model in seconds), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from tracekit.dtypes import torch_dtype

    cfg = _config(name, smoke)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype(dtype), attn_implementation="sdpa")
    model = model.to(device).eval()
    if peaked:
        peak_lm_head(model)
    return model


def tie_stats(model, prompts: list[list[int]], batch: int = 8) -> dict:
    """BF16-or-model-dtype next-token logits at every prompt position: the top-2 gap (nats),
    the exact-tie rate, gaps within one grid step, the top-1 probability and the top logit."""
    import torch

    gaps, p1, top = [], [], []
    dev = next(model.parameters()).device
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            x = torch.tensor(prompts[i : i + batch], device=dev)
            logits = model(input_ids=x).logits  # [B, T, V] model dtype
            t2 = logits.topk(2, dim=-1).values.float()  # exact values of the model dtype
            gaps.append((t2[..., 0] - t2[..., 1]).flatten().cpu())
            top.append(t2[..., 0].flatten().cpu())
            p1.append(torch.softmax(logits.float(), dim=-1).amax(-1).flatten().cpu())
    gap, top1, prob = torch.cat(gaps), torch.cat(top), torch.cat(p1)
    ulp = torch.exp2(torch.floor(torch.log2(top1.abs().clamp(min=1e-30))) - 7)  # BF16 step at the top logit
    return {
        "positions": int(gap.numel()),
        "median_top2_gap_nats": round(float(gap.median()), 4),
        "exact_tie_rate": round(float((gap == 0).float().mean()), 5),
        "within_one_bf16_step_rate": round(float((gap <= ulp).float().mean()), 5),
        "median_top1_prob": round(float(prob.median()), 4),
        "median_top1_logit": round(float(top1.median()), 3),
    }


def save(model, name: str, out: Path, smoke: bool = False) -> Path:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    write_tokenizer(model.config, d)
    (d / "build_info.json").write_text(
        json.dumps({"name": name, "seed": SEED, "tau": TAU, "smoke": smoke, "weights": "random"}, indent=1)
    )
    for p in d.iterdir():  # save_pretrained may write 0600
        p.chmod(0o644)
    return d


def load_prompts(path: Path, n: int = 16) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[:n]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b,gemma3-1b")
    ap.add_argument("--stats-only", default="llama3-8b", help="models measured but not saved")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "fixtures/prompts/study_128.jsonl"))
    ap.add_argument("--json", default=None, help="write the tie statistics here")
    a = ap.parse_args(argv)
    import torch

    prompts = load_prompts(Path(a.prompts))
    out, stats = Path(a.out), {}
    names = [m for m in a.models.split(",") if m] + [m for m in a.stats_only.split(",") if m]
    for name in names:
        t0 = time.perf_counter()
        model = build(name, a.device, a.smoke, peaked=False)
        default = tie_stats(model, prompts)
        peak_lm_head(model)
        peaked = tie_stats(model, prompts)
        if name in a.models.split(","):
            save(model, name, out, a.smoke)
        params = sum(p.numel() for p in model.parameters())
        stats[name] = {"params": params, "default_init": default, "peaked": peaked, "build_s": 0.0}
        stats[name]["build_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {params / 1e9:.2f}B params; default {default}; peaked {peaked}", flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    doc = {"seed": SEED, "tau": TAU, "dtype": "bf16", "prompts": a.prompts, "device": a.device, "models": stats}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
