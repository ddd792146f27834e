"""B1 vs B4: one engine lane against four, under one concurrent burst, with memory evidence.

For each `--slots N` the reference engine is started alone on the device, one burst of
every prompt at concurrency C is captured (a `tracekit capture` run, the trace kept),
and while it runs a sampler reads `/metrics` every 0.1 s. Per configuration:

- throughput: generated tokens of `ok` requests / wall span of the burst; requests that
  timed out or failed are counted as failures, never as speed;
- TTFT p50 / max and completion (end-to-end) max of `ok` requests, seconds;
- lanes observed: the most requests `tracekit:num_requests_running` showed at once, and
  the mean decode batch over the burst (decode rows / decode steps); the check fails when
  an engine configured for more than one slot never ran more than one request at once;
- memory: the engine's self-report (/v1/models meta) after the burst: KV bytes per slot
  predicted from the config, bytes allocated, weights, and the measured device peak.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Sampler:
    """Reads /metrics every `period_s` in a thread until stopped; keeps the gauges' maxima."""

    url: str
    period_s: float = 0.1
    running_max: float = 0.0
    waiting_max: float = 0.0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Sampler":
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            m = metrics(self.url)
            self.running_max = max(self.running_max, m.get("tracekit:num_requests_running", 0.0))
            self.waiting_max = max(self.waiting_max, m.get("tracekit:num_requests_waiting", 0.0))
            self.samples += 1
            self._stop.wait(self.period_s)


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {name: value} for unlabelled samples (label sets are summed)."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def self_report(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["meta"]


def burst_figures(trace: Path, timeout_s: float) -> dict:
    """Throughput, TTFT and completion of ok rows; failures by status."""
    import numpy as np

    from tracekit.store import TraceReader

    with TraceReader(trace) as r:
        t = r.requests
    ok = t.status == "ok"
    status = {str(s): int((t.status == s).sum()) for s in np.unique(t.status)}
    if not ok.any():
        return {"requests": int(len(t.status)), "ok": 0, "status": status}
    span = float(t.t_done_s[ok].max() - t.t_sent_s[ok].min())
    ttft = (t.t_first_token_s - t.t_sent_s)[ok]
    e2e = (t.t_done_s - t.t_sent_s)[ok]
    return {
        "requests": int(len(t.status)),
        "ok": int(ok.sum()),
        "status": status,
        "failed": int((~ok).sum()),
        "over_timeout": int((e2e > timeout_s).sum()) + int((~ok).sum()),
        "tokens": int(t.n_tokens[ok].sum()),
        "span_s": round(span, 2),
        "tokens_per_s": round(float(t.n_tokens[ok].sum()) / span, 2) if span > 0 else None,
        "ttft_s_p50": round(float(np.median(ttft)), 3),
        "ttft_s_max": round(float(ttft.max()), 3),
        "completion_s_max": round(float(e2e.max()), 3),
    }


def run_config(model: str, slots: int, prompts: str, out: Path, cfg: dict) -> dict:
    """One engine configuration: start it, one burst with the sampler on, its figures."""
    from tracekit.capture.http import CaptureConfig, run_capture
    from tracekit.engine.process import start_engine

    args = ["--model", model, "--dtype", cfg["dtype"], "--device", cfg["device"], "--slots", str(slots)]
    args += ["--max-context", str(cfg["max_context"]), "--no-prefix-cache"]
    trace = out / f"b{slots}.h5"
    t0 = time.perf_counter()
    with start_engine(args, timeout_s=900, log_path=out / f"b{slots}.log") as eng:
        startup = time.perf_counter() - t0
        before, meta0 = metrics(eng.url), self_report(eng.url)
        sampler = Sampler(eng.url).start()
        cap = CaptureConfig(
            url=eng.url,
            prompts=prompts,
            out=str(trace),
            concurrency=cfg["concurrency"],
            max_tokens=cfg["max_tokens"],
            top_logprobs=5,
            ignore_eos=True,
            timeout_s=cfg["timeout_s"],
            progress=False,
            run_meta={"mode": "burst", "cell": f"b{slots}", "matrix": "lanes"},
        )
        try:
            run_capture(cap)
        finally:
            sampler.stop()
        after, meta1 = metrics(eng.url), self_report(eng.url)
    steps = after.get("tracekit:decode_steps_total", 0) - before.get("tracekit:decode_steps_total", 0)
    rows = after.get("tracekit:decode_rows_total", 0) - before.get("tracekit:decode_rows_total", 0)
    lanes_max = int(sampler.running_max)
    return {
        "slots": slots,
        "startup_s": round(startup, 1),
        "burst": burst_figures(trace, cfg["timeout_s"]),
        "lanes_max_running": lanes_max,
        "waiting_max": int(sampler.waiting_max),
        "metric_samples": sampler.samples,
        "mean_decode_batch": round(rows / steps, 3) if steps else None,
        "lanes_check": "pass" if slots == 1 or lanes_max > 1 else "fail",
        "meta_at_start": {k: meta0.get(k) for k in MEM_KEYS},
        "meta_after_burst": {k: meta1.get(k) for k in MEM_KEYS},
        "trace": trace.name,
    }


MEM_KEYS = (
    "dtype",
    "slots",
    "max_context",
    "kv_bytes_per_slot",
    "kv_formula",
    "kv_bytes_allocated",
    "weights_bytes",
    "device_peak_bytes",
    "device_allocated_bytes",
    "device_total_bytes",
    "attn_kernels",
)


def run_lanes(model: str, prompts: str, out: Path, slots=(1, 4), **kw) -> dict:
    cfg = dict(dtype="bf16", device="cuda", max_context=9216, concurrency=16, max_tokens=128, timeout_s=180.0)
    cfg.update(kw)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_config(model, n, prompts, out, cfg) for n in slots]
    doc = {"model": model, "prompts": prompts, "config": cfg, "results": results}
    (out / "lanes.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def table(doc: dict) -> str:
    """The B1/B4 markdown table (timeouts are failures, never speed)."""
    head = (
        "| slots | ok / sent | failed or over timeout | tok/s | TTFT p50 / max s | completion max s "
        "| lanes seen (max running) | mean decode batch | lanes check |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in doc["results"]:
        b = r["burst"]
        lines.append(
            f"| {r['slots']} | {b.get('ok')}/{b.get('requests')} | {b.get('over_timeout', '?')} | "
            f"{b.get('tokens_per_s')} | {b.get('ttft_s_p50')} / {b.get('ttft_s_max')} | {b.get('completion_s_max')} | "
            f"{r['lanes_max_running']} | {r['mean_decode_batch']} | {r['lanes_check']} |"
        )
    return "\n".join(lines)


def memory_fit(doc: dict) -> dict | None:
    """peak(N) = base + N x per_lane from the two configurations with the fewest and most slots
    (the measured allocator peaks); None with fewer than two CUDA measurements."""
    pts = sorted(
        (r["slots"], r["meta_after_burst"]["device_peak_bytes"])
        for r in doc["results"]
        if r["meta_after_burst"].get("device_peak_bytes") is not None
    )
    if len(pts) < 2 or pts[0][0] == pts[-1][0]:
        return None
    (n0, p0), (n1, p1) = pts[0], pts[-1]
    per_lane = (p1 - p0) / (n1 - n0)
    return {"base_bytes": p0 - n0 * per_lane, "per_lane_bytes": per_lane}


def lanes_that_fit(base: float, per_lane: float, device_bytes: float) -> int:
    return max(0, min(999, int((device_bytes - base) // per_lane))) if per_lane > 0 else 999


def memory_table(doc: dict, devices=(16.9e9, 80e9, 141e9)) -> str:
    """Predicted (config: weights + N x KV per slot) vs measured (allocator peak) memory per
    configuration, and how many lanes fit each device by the prediction and by the measured fit."""
    g = lambda x: "?" if x is None else f"{x / 1e9:.2f}"  # noqa: E731
    lines = [
        "| slots | KV/slot predicted GB | weights GB | predicted need GB | peak measured GB | measured ÷ predicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        m = r["meta_after_burst"]
        need = m["weights_bytes"] + r["slots"] * m["kv_bytes_per_slot"]
        peak = m.get("device_peak_bytes")
        ratio = "?" if peak is None else f"{peak / need:.2f}"
        kv, w = g(m["kv_bytes_per_slot"]), g(m["weights_bytes"])
        lines.append(f"| {r['slots']} | {kv} | {w} | {g(need)} | {g(peak)} | {ratio} |")
    m = doc["results"][0]["meta_after_burst"]
    fit = memory_fit(doc)
    lines += ["", "| lanes that fit | " + " | ".join(f"{d / 1e9:g} GB" for d in devices) + " |"]
    lines.append("|---|" + "---|" * len(devices))
    pred = [lanes_that_fit(m["weights_bytes"], m["kv_bytes_per_slot"], d) for d in devices]
    lines.append("| predicted (weights + N x KV/slot) | " + " | ".join(map(str, pred)) + " |")
    if fit:
        meas = [lanes_that_fit(fit["base_bytes"], fit["per_lane_bytes"], d) for d in devices]
        lines.append(
            f"| measured fit ({g(fit['base_bytes'])} GB + N x {g(fit['per_lane_bytes'])} GB) | "
            + " | ".join(map(str, meas))
            + " |"
        )
    return "\n".join(lines)
