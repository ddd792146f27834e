"""Load an HF causal LM for teacher-forced forwards, and its KV-cache helpers.

What every history needs from the model: loading it in one dtype (names from
tracekit/dtypes.py), the attention implementation, the forward's cache keyword
(tracekit/hfcompat.py) and cache forking. torch and transformers are imported lazily.
"""

from __future__ import annotations

import copy
from typing import Any

from tracekit.dtypes import torch_dtype
from tracekit.errors import ConfigError
from tracekit.hfcompat import cache_keyword

from .records import LoadedModel, Rank


def load_model(
    model_dir: str,
    dtype: str,
    device: str = "cpu",
    attn: str = "auto",
    cuda_graphs: bool = True,
    rank: Rank | None = None,
) -> LoadedModel:
    """Load an HF causal-LM directory in one dtype; a bad directory is a ConfigError.

    device: cpu, cuda, cuda:N, or auto = transformers' own multi-GPU placement
    (`device_map="auto"`, layers split across the visible GPUs; needs accelerate).
    rank: inside a rank that tp.launch started, the model's own tensor-parallel plan
    over the initialized process group, on rank.device; decode steps run eagerly.
    """
    import importlib.util
    import sys

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():  # progress bars only on a terminal
        hf_logging.disable_progress_bar()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is visible to torch; use --device cpu")
    if device == "auto" and importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            "--device auto uses transformers' device_map='auto', which needs the accelerate "
            "package (pip install accelerate); or pass --device cuda for one GPU"
        )
    kwargs = {"device_map": "auto"} if device == "auto" else {}
    if rank is not None:
        kwargs, device = tp_load_kwargs(rank.world), rank.device
    attn = resolve_attn(attn, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype(dtype), attn_implementation=attn, **kwargs
        )
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{model_dir}: cannot load as an HF causal LM ({first})") from None
    if rank is not None:  # transformers placed each shard on this rank's device; graphs cannot hold a gloo collective
        lm = wrap_model(model.eval(), dtype, device, cuda_graphs=False)
        lm.reuse_prefixes = False  # ranks verifying alone could run different forwards (reuse.py)
        return lm
    if device == "auto":  # inputs go where the embedding lives; accelerate's hooks move activations on
        return wrap_model(model.eval(), dtype, str(model.get_input_embeddings().weight.device), cuda_graphs)
    return wrap_model(model.to(device).eval(), dtype, device, cuda_graphs)


def tp_load_kwargs(tp: int) -> dict:
    """from_pretrained's arguments for the model's own plan over tp ranks: DistributedConfig in
    transformers 5.x (5.17 and 5.24 have it; the bare tp_plan keyword is deprecated there), else
    the tp_plan="auto" keyword of earlier releases."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto", "tp_size": tp}
    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp)}


ATTNS = ("sdpa", "eager", "sdpa_lower_right", "auto")


def resolve_attn(attn: str, device: str) -> str:
    """The attn_implementation to load: `auto` is `sdpa_lower_right` on CUDA
    (flash kernel for every segment, attention.py) and `sdpa` elsewhere (on
    CPU both run the same masked kernel; `sdpa` keeps transformers' own path)."""
    if attn not in ATTNS:
        raise ConfigError(f"--attn {attn!r}: expected one of {', '.join(ATTNS)}")
    if attn == "auto":
        attn = "sdpa_lower_right" if device.startswith("cuda") or device == "auto" else "sdpa"
    if attn == "sdpa_lower_right":
        from .attention import register

        register()
    return attn


def wrap_model(model: Any, dtype: str, device: str, cuda_graphs: bool = True) -> LoadedModel:
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return LoadedModel(model, dtype, device, cache_keyword(model), vocab, cuda_graphs)


def fork_cache(cache):
    """A cache that can grow independently of `cache`.

    DynamicLayer.update replaces its tensors with torch.cat results and never
    writes into them, so shallow copies of the layers share the prefix tensors
    safely (no copy, bitwise the same contents). Any other layer type, which
    may update in place, is deep-copied.
    """
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        return copy.deepcopy(cache)
    forked = copy.copy(cache)
    forked.layers = [copy.copy(layer) for layer in layers]
    return forked
