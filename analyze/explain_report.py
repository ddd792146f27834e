"""How `tracekit explain` prints an `ExplainResult`: plain text, markdown for a pull
request, and the JSON document (schema tracekit.explain/1, `ExplainResult.to_json`)."""

from __future__ import annotations

from .explain import ExplainResult, PairExplanation


def summary_line(r: ExplainResult) -> str:
    c = r.counts()
    parts = [f"{v} {k.replace('_', ' ')}" for k, v in c.items() if v and k != "loud"]
    loud = f" · {c['loud']} LOUD (benign class, no numeric cause)" if c["loud"] else ""
    return f"{len(r.pairs)} pairs explained: " + (", ".join(parts) or "none") + loud


def _runs(p: PairExplanation, config: str = "engine") -> str:
    cs = [c for c in p.variants if c.config == config]
    return ", ".join(f"{c.variant} B {c.b}/{c.n} A {c.a}/{c.n}" + (f" early {c.early}" if c.early else "") for c in cs)


def _head(p: PairExplanation) -> str:
    return (
        f"{p.key}  {p.klass}  t={p.position}  token A {p.token_a} / B {p.token_b}  "
        f"reused prefix A {p.boundary_a} / B {p.boundary_b}  {p.mates} batch mates in B"
    )


def text(r: ExplainResult) -> str:
    lines = [f"A = {r.a}", f"B = {r.b}", summary_line(r), ""]
    for p in r.pairs:
        lines += [_head(p), f"  {p.cause}", f"  right: {p.right}", f"  engine runs: {_runs(p) or 'none'}"]
        lines += [f"  {e}" for e in p.evidence]
        lines.append("")
    lines += [f"skipped: {s}" for s in r.skipped]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines).rstrip()


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def markdown(r: ExplainResult) -> str:
    out = [
        "### tracekit explain",
        "",
        f"A = `{r.a}`, B = `{r.b}`. {summary_line(r)}.",
        "",
        "| key | class | t | token A / B | reused prefix A / B | cause | right side |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in r.pairs:
        out.append(
            f"| {p.key} | {p.klass} | {p.position} | {p.token_a} / {p.token_b} | {p.boundary_a} / {p.boundary_b} "
            f"| {_cell(p.cause)} | {p.right_side or 'unknown'} |"
        )
    out += ["", "<details><summary>runs per variant</summary>", ""]
    for p in r.pairs:
        out.append(f"- **{p.key}**: {_cell(_runs(p) or 'none')}; {p.right}")
        out += [f"  - {_cell(e)}" for e in p.evidence]
    out += ["", "</details>", ""]
    out += [
        "Each run replays the pair's prompt; `B k/n` = B's token at t in k of n runs (after A's exact tokens "
        "before t); `early` = runs that left A's tokens before t. A run counts toward a cause only when it is "
        f"numeric (drift before t and the A/B gap at t within {r.drift_nats:g} nats)."
    ]
    out += [f"- skipped: {_cell(s)}" for s in r.skipped]
    out += [f"- note: {_cell(n)}" for n in r.notes]
    return "\n".join(out)
