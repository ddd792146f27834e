"""`tracekit serve`: the reference OpenAI-compatible engine (see docs/engine.md)."""

from __future__ import annotations

import asyncio
import logging
import os

import click

from ..dtypes import NAMES as DTYPE_NAMES
from ..errors import ConfigError


def _fault(ctx, param, value):
    """Validate --inject-fault early (usage error, exit 2); the canonical spelling goes on."""
    from ..engine.faults import parse_fault

    try:
        f = parse_fault(value)
    except ConfigError as e:
        raise click.BadParameter(str(e).split(": ", 1)[-1]) from None
    return None if f is None else f.name


@click.command(epilog="Example: tracekit serve --dtype bf16 --slots 8 --port 8000")
@click.option("--model", "model_dir", default=None, help="HF causal-LM directory (default: the fixture model).")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="fp32", show_default=True)
@click.option(
    "--attn",
    type=click.Choice(["sdpa", "eager"]),
    default="sdpa",
    show_default=True,
    help="Attention implementation (BF16 prefix-split flips appear with sdpa).",
)
@click.option("--slots", type=click.IntRange(1, 256), default=4, show_default=True, help="Concurrent sequences.")
@click.option(
    "--max-context",
    type=click.IntRange(8),
    default=None,
    help="Tokens per sequence (default: the model's limit, at most 4096).",
)
@click.option("--block-size", type=click.IntRange(1), default=16, show_default=True, help="Prefix-cache block.")
@click.option(
    "--cache-blocks",
    type=click.IntRange(1),
    default=4096,
    show_default=True,
    help="Prefix-cache capacity in blocks (LRU beyond).",
)
@click.option("--no-prefix-cache", is_flag=True, help="Disable prefix reuse.")
@click.option(
    "--prefill-chunk",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Prompt tokens per prefill forward, decode steps run in between (0 = whole prompt).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; anything but loopback prints a warning (use --api-key-env there).",
)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 = any free port.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--threads", type=click.IntRange(0), default=0, help="torch CPU threads (0 = torch default).")
@click.option(
    "--read-timeout",
    "read_timeout_s",
    type=click.FloatRange(0.1, 3600),
    default=30.0,
    show_default=True,
    help="Seconds a client gets to send its first request's headers, and each request body.",
)
@click.option("--api-key-env", default=None, metavar="VAR", help="Require `Authorization: Bearer $VAR`.")
@click.option("--served-model-name", default=None, help="Name in /v1/models (default: the directory name).")
@click.option(
    "--inject-fault",
    default=None,
    metavar="KIND[:MAG]",
    callback=_fault,
    help="TESTING ONLY: imitate a real engine bug, e.g. corrupt-prefix-cache, perturb-kv:EPS, batch-scale:EPS, "
    "open-pad-column:N, kv-row-swap:P, prefix-key-collision:N, prefix-use-after-free:N, hit-position-offset:K, "
    "chunk-boundary:K, topk-misorder:P, stale-logprobs:P, cached-tokens-off:K, early-stop:P, wrong-row-sample:P "
    "(docs/engine.md, 'Fault switches').",
)
@click.option(
    "--batch-invariant",
    is_flag=True,
    help="Deterministic mode: each decode row computed as if alone, one prefill forward per block "
    "(outputs independent of batch mates and of the reused-prefix boundary; slower).",
)
@click.option(
    "--eager-decode",
    is_flag=True,
    help="Decode steps eagerly, not as CUDA graphs (the graphs are bitwise the eager step; CUDA only).",
)
@click.option(
    "--unfused",
    is_flag=True,
    help="Separate q/k/v and gate/up GEMMs (CUDA fuses them only where a load-time check finds it bitwise).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log engine internals to stderr.")
def cmd(
    model_dir,
    dtype,
    attn,
    slots,
    max_context,
    block_size,
    cache_blocks,
    no_prefix_cache,
    prefill_chunk,
    host,
    port,
    device,
    threads,
    read_timeout_s,
    api_key_env,
    served_model_name,
    inject_fault,
    batch_invariant,
    eager_decode,
    unfused,
    verbose,
) -> None:
    """Serve a causal LM over an OpenAI-compatible /v1/completions API.

    Prints `tracekit serve: listening on http://HOST:PORT` on stderr once the
    socket is bound; /health answers 503 until the model is loaded.
    """
    from ..engine.executor import check_model_dir, default_model_dir
    from ..engine.faults import parse_fault
    from ..engine.server import ServeConfig, serve

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    model_dir = model_dir or str(default_model_dir())
    check_model_dir(model_dir)  # before binding: a bad directory is one `Error:` line, exit 3
    needs = parse_fault(inject_fault).spec.needs if inject_fault else ""
    if needs == "prefix_cache" and no_prefix_cache:
        raise click.UsageError(f"--inject-fault {inject_fault} acts on the prefix cache: drop --no-prefix-cache")
    if needs == "prefill_chunk" and prefill_chunk <= 0:
        raise click.UsageError(f"--inject-fault {inject_fault} acts at prefill chunk boundaries: set --prefill-chunk")
    if batch_invariant and prefill_chunk % block_size:
        raise click.UsageError(
            "--batch-invariant splits a prefill only at blocks: make --prefill-chunk a multiple of --block-size"
        )
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ConfigError(f"--api-key-env {api_key_env}: that environment variable is empty or unset")
    cfg = ServeConfig(
        model_dir=model_dir,
        dtype=dtype,
        attn=attn,
        slots=slots,
        max_context=max_context,
        block_size=block_size,
        prefix_cache=not no_prefix_cache,
        cache_blocks=cache_blocks,
        host=host,
        port=port,
        device=device,
        api_key=api_key,
        fault=inject_fault,
        served_name=served_model_name,
        threads=threads,
        prefill_chunk=prefill_chunk,
        batch_invariant=batch_invariant,
        eager_decode=eager_decode,
        unfused=unfused,
        read_timeout_s=read_timeout_s,
    )
    asyncio.run(serve(cfg))
