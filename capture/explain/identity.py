"""Is the engine `tracekit explain` reruns on the one the traces ran on? (issue 24 item 1)

explain reruns each divergent pair on a live engine and names a cause from what that engine
does; on another engine (another dtype, another slot count, the prefix cache off where the
traces had it on, another model) it "explains" flips that engine never made. So before any
variant runs, each URL's self-report (the probe `tracekit capture` runs: `/v1/models`, `/props`,
`/info`, ... and the dtype the engine reports) is compared with the run metadata of A and B:

| fact | engine (probe) | trace (run record) |
|---|---|---|
| `family` | the engine behind the server (tracekit, vllm, llamacpp, ...) | `engine_family` |
| `model` | `/v1/models` id (TGI: `model_id`) | `model` |
| `dtype` | the engine's own dtype report | `dtype` (the capture's, same sources) |
| `slots` | tracekit `meta.slots`, llama.cpp `/props` `total_slots` | the same, from `engine` |
| `prefix_cache` | tracekit `meta.prefix_cache` | the same |
| `batch_invariant`, `inject_fault` | tracekit `meta` | the same |

A fact unknown on either side is not compared (an older trace, an engine that does not say).
`--url` is the engine B ran on: the `engine` configuration is checked against B on every fact;
the deterministic and FP32 ones are other configurations of the same engine on purpose, so
against B only on `family` and `model`. A may come from another configuration or engine (an
FP32 reference, a healthy engine where B's had a fault: explain then finds B's flip on B's
engine alone, which is its answer), so against A only the `model` is checked. A mismatch is one
ConfigError line naming each differing fact, unless allowed (`--allow-engine-mismatch`): then it
is said in the notes. The URL, the facts and the raw self-report go into explain.json.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tracekit.dtypes import normalise
from tracekit.errors import ConfigError
from tracekit.runrecord import RunRecord
from tracekit.store import TraceReader

from .. import runmeta
from ..client import make_session
from ..probe import probe

FIELDS = ("family", "model", "dtype", "slots", "prefix_cache", "batch_invariant", "inject_fault")
CONFIG_FIELDS = {"engine": FIELDS, "deterministic": ("family", "model"), "fp32": ("family", "model")}
A_FIELDS = ("model",)  # the reference side: the same model, whatever configuration
ALLOW_FLAG = "--allow-engine-mismatch"


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def facts(raw: dict, family: str | None, model: str | None, dtype: str | None) -> dict:
    """The comparable facts of one self-report (as the probe stores it in `run.engine`)."""
    models = raw.get("v1_models") if isinstance(raw.get("v1_models"), dict) else {}
    meta = models.get("meta") if isinstance(models.get("meta"), dict) else {}
    props = raw.get("props") if isinstance(raw.get("props"), dict) else {}
    fault = None
    if "inject_fault" in meta:  # tracekit serve says it always: None is "healthy", a fact too
        fault = str(meta["inject_fault"]) if meta["inject_fault"] else "none"
    return {
        "family": family or None,
        "model": model or None,
        "dtype": normalise(dtype) if dtype else None,
        "slots": _int(meta.get("slots")) or _int(props.get("total_slots")),
        "prefix_cache": _bool(meta.get("prefix_cache")),
        "batch_invariant": _bool(meta.get("batch_invariant")),
        "inject_fault": fault,
    }


def trace_facts(path: str) -> dict:
    """The facts a trace's run metadata holds about the engine it ran on ({} of a replay)."""
    with TraceReader(path) as r:
        if r.meta.source != "http":
            return {}
        rec: RunRecord = r.meta.record
    return facts(dict(rec.engine.raw), rec.engine_family, rec.model, rec.dtype.value)


async def _probe(url: str, api_key_env: str | None, timeout_s: float) -> dict:
    key = os.environ.get(api_key_env) if api_key_env else None
    base = url.rstrip("/")
    async with make_session(1, min(timeout_s, 30.0), key) as s:
        pr = await probe(s, base, "auto")
        numerics = await runmeta.engine_numerics(s, base, pr.dialect, pr.engine)
    return {
        "url": url,
        "dialect": pr.dialect,
        "facts": facts(pr.engine, pr.engine_kind, pr.model, numerics.get("dtype")),
        "self_report": pr.engine,
    }


def probe_engine(url: str, api_key_env: str | None = None, timeout_s: float = 30.0) -> dict:
    """{url, dialect, facts, self_report} of the engine at `url` (no generation request)."""
    return asyncio.run(_probe(url, api_key_env, timeout_s))


def mismatches(engine: dict, trace: dict, fields=FIELDS) -> list[tuple[str, Any, Any]]:
    """(fact, engine's value, trace's value) of each fact both know and that differs."""
    return [
        (f, engine.get(f), trace.get(f))
        for f in fields
        if engine.get(f) is not None and trace.get(f) is not None and engine.get(f) != trace.get(f)
    ]


def _shown(v: Any) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def describe(f: dict) -> str:
    """`tracekit, model tiny, bf16, 8 slots, prefix cache on` from the known facts."""
    parts = [f["family"] or "engine of unknown family"]
    if f.get("model"):
        parts.append(f"model {f['model']}")
    if f.get("dtype"):
        parts.append(f["dtype"])
    if f.get("slots") is not None:
        parts.append(f"{f['slots']} slots")
    if f.get("prefix_cache") is not None:
        parts.append(f"prefix cache {_shown(f['prefix_cache'])}")
    if f.get("batch_invariant"):
        parts.append("batch-invariant")
    if f.get("inject_fault") not in (None, "none"):
        parts.append(f"fault {f['inject_fault']}")
    return ", ".join(parts)


def check(config: str, report: dict, traces: list[tuple[str, str, dict]], allow: bool) -> tuple[dict, str]:
    """Compare one configuration's engine with each trace ((label, path, facts) of A and B).
    Returns (the explain.json entry, its note line); raises ConfigError on a mismatch unless
    `allow`."""
    b_fields = CONFIG_FIELDS.get(config, FIELDS)
    fields = {label: A_FIELDS if label == "A" else b_fields for label, _, _ in traces}
    found = {label: mismatches(report["facts"], tf, fields[label]) for label, _, tf in traces}
    bad = {label: m for label, m in found.items() if m}
    checked = [label for label, _, tf in traces if tf]
    what = "; ".join(
        f"{label} ({os.path.basename(path)}): "
        + ", ".join(f"{f} {_shown(e)} at the URL, {_shown(t)} in the trace" for f, e, t in bad[label])
        for label, path, _ in traces
        if label in bad
    )
    entry = {
        "url": report["url"],
        "dialect": report["dialect"],
        "facts": report["facts"],
        "self_report": report["self_report"],
        "compared": {label: list(f) for label, f in fields.items()},
        "checked_against": checked,
        "mismatches": {label: [{"fact": f, "engine": e, "trace": t} for f, e, t in m] for label, m in bad.items()},
        "mismatch_allowed": bool(bad) and allow,
    }
    head = f"{config} configuration: {report['url']} ({describe(report['facts'])})"
    if bad and not allow:
        raise ConfigError(
            f"explain --url {report['url']}: not the engine the traces ran on: {what}; point the URL at "
            f"that engine, or pass {ALLOW_FLAG} to explain on this one anyway"
        )
    if bad:
        note = f"{head}: MISMATCH explained anyway ({ALLOW_FLAG}): {what}; the causes describe this engine"
    elif checked:
        on = "; ".join(f"{label} on {', '.join(fields[label])}" for label in checked)
        note = f"{head}: matches {on} (where both report them)"
    else:
        note = f"{head}: not checked (the traces hold no engine self-report)"
    return entry, note
