"""Prometheus text for /metrics. Names mirror vLLM's (`vllm:` -> `tracekit:`); token counters count tokens."""

from __future__ import annotations


def render(engine, cfg) -> str:
    if engine is None:
        return "# model loading\n"
    s, c = engine.snapshot(), engine.counters
    cache = engine.cache
    rows = [
        ("num_requests_running", "gauge", "Requests holding a slot.", s["running"]),
        ("num_requests_waiting", "gauge", "Requests queued for a slot.", s["waiting"]),
        ("slots_busy", "gauge", "Slots in use.", s["slots_busy"]),
        ("slots_total", "gauge", "Slots configured.", s["slots"]),
        (
            "prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            cache.queries_tokens if cache else 0,
        ),
        (
            "prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            cache.hits_tokens if cache else 0,
        ),
        ("prefix_cache_blocks", "gauge", "Blocks held by the prefix cache.", len(cache.blocks) if cache else 0),
        ("prompt_tokens_total", "counter", "Prompt tokens admitted.", c.prompt_tokens),
        ("generation_tokens_total", "counter", "Tokens generated.", c.generation_tokens),
        ("requests_cancelled_total", "counter", "Requests cancelled (client disconnect).", c.cancelled),
        ("request_errors_total", "counter", "Requests failed inside the engine.", c.errors),
        ("prefill_forwards_total", "counter", "Prefill forwards run.", c.prefills),
        ("decode_steps_total", "counter", "Batched decode forwards run.", c.decode_steps),
        ("decode_rows_total", "counter", "Rows over all decode forwards (rows/steps = mean batch).", c.decode_rows),
        (
            "engine_busy_seconds_total",
            "counter",
            "Wall seconds the owner loop spent in prefill and decode.",
            round(c.busy_s, 6),
        ),
    ]
    out = []
    for name, kind, help_, val in rows:
        out += [f"# HELP tracekit:{name} {help_}", f"# TYPE tracekit:{name} {kind}", f"tracekit:{name} {val}"]
    out += [
        "# HELP tracekit:requests_finished_total Requests finished, by reason.",
        "# TYPE tracekit:requests_finished_total counter",
    ]
    for reason in ("stop", "length"):
        out.append(f'tracekit:requests_finished_total{{finished_reason="{reason}"}} {c.finished[reason]}')
    return "\n".join(out) + "\n"
