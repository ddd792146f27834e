"""The rule text of every verdict: why pair i got its class, with the numbers.

A benign text states each part of the claim with its numbers and tolerance; an
`unexplained` text names every check that failed ("B chose token 9, 11.1 nats
below its own top-1 5"; "same 6 token ids, but logprobs drift 5.99 nats").
Formatting only: the decisions are made in classify.py.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .evidence import CAND_LOGIT, COLUMN, DUP_ID, POS_INF, POSITIVE_LP, SUM_OVER_ONE, UNKNOWN_ABOVE

C = Mapping[str, np.ndarray]


def _n(x: float, fmt: str = ".3g") -> str:
    return format(float(x), fmt) if np.isfinite(x) else "?"


def _signed(x: float) -> str:
    return f"{float(x):+.3g}" if np.isfinite(x) else "?"


def _dist(c: C, i: int, name: str, signed: bool = False) -> str:
    """A distance measured in steps when raw logits gave it, else in nats."""
    ulp, nats = c[f"{name}_ulp"][i] if f"{name}_ulp" in c else np.nan, c[name][i]
    fmt = _signed if signed else (lambda x: _n(abs(x)))
    return f"{fmt(ulp)} ulp" if np.isfinite(ulp) else f"{fmt(nats)} nats"


def _unit(c: C, i: int, name: str) -> str:
    return "ulps" if f"{name}_ulp" in c and np.isfinite(c[f"{name}_ulp"][i]) else "nats"


def _tol(c: C, i: int, kind: str, name: str) -> str:
    """The tolerance `kind` (tie|drift) in the unit `name` was measured in."""
    u = _unit(c, i, name)
    return f"{c[f'tol_{kind}_{u}'][i]:g} {u[:-1] if u == 'ulps' else u}"


def _drift_unit(c: C, i: int) -> str:
    return "ulp" if c["drift_on_logits"][i] else "nats"


def _mean_bound(c: C, i: int, n: int) -> float:
    x, m = c["drift_tol"][i], c["drift_mean_tol"][i]
    return m + (x - m) / max(n, 1)


def drift_text(c: C, i: int, prefix: str = "") -> str:
    """'drift max 0.052 / mean 0.0081 nats over 25 positions <= 0.5 / 0.08' (benign form)."""
    mx, mean, n = c[f"{prefix}drift_max"][i], c[f"{prefix}drift_mean"][i], int(c[f"{prefix}drift_n"][i])
    if not np.isfinite(mx):
        return "no logprob to compare before it" if not n else "drift ?"
    on = " (raw logits)" if c["drift_on_logits"][i] else ""
    return (
        f"drift{on} max {_n(mx)} / mean {_n(mean)} {_drift_unit(c, i)} over {n} positions <= "
        f"{c['drift_tol'][i]:g} / {_n(_mean_bound(c, i, n))}"
    )


def drift_failures(c: C, i: int, prefix: str = "", where: str = "before the flip") -> list[str]:
    out = []
    at = f" {where}" if where else ""
    nf, pos = int(c[f"{prefix}nonfinite"][i]), int(c[f"{prefix}nonfinite_pos"][i])
    if nf:
        va, vb = c["nonfinite_a"][i], c["nonfinite_b"][i]
        seen = f" (A {va:.4g} vs B {vb:.4g})" if not prefix else ""
        out.append(f"a logprob is NaN/inf on one side only at {nf} position(s){at}, first at {pos}{seen}")
    inc = int(c[f"{prefix}inconsistent"][i])
    if inc:
        first = f"first at {int(c[f'{prefix}inconsistent_pos'][i])}"
        if not prefix and np.isfinite(c["inconsistent_side"][i]):
            who = "AB"[int(c["inconsistent_side"][i])]
            first += (
                f": {who}'s column {_n(c['inconsistent_col'][i])}, its top-k row {_n(c['inconsistent_topk'][i])} nats"
            )
        out.append(f"a logprob column contradicts the same token's top-k entry at {inc} position(s){at}, {first}")
    mx, mean, n = c[f"{prefix}drift_max"][i], c[f"{prefix}drift_mean"][i], int(c[f"{prefix}drift_n"][i])
    u, what = _drift_unit(c, i), ("raw logits" if c["drift_on_logits"][i] else "logprobs")
    if np.isfinite(mx) and mx > c["drift_tol"][i]:
        raw = f" (a logit moved by {_n(c['drift_raw_max'][i])})" if c["drift_on_logits"][i] and not prefix else ""
        out.append(f"{what} drift {_n(mx)} {u}{at}{raw} > {c['drift_tol'][i]:g} ({c['dtype'][i]})")
    elif np.isfinite(mean) and mean > _mean_bound(c, i, n):
        out.append(
            f"mean drift {_n(mean)} {u} over {n} positions{at} > {_n(_mean_bound(c, i, n))} "
            f"({c['dtype'][i]}: {c['drift_mean_tol'][i]:g} + ({c['drift_tol'][i]:g} - "
            f"{c['drift_mean_tol'][i]:g}) / {n})"
        )
    return out


def rule_text(c: C, i: int) -> str:
    """Why pair i got its class, with the numbers that decided it."""
    cls = c["cls"][i]
    if cls == "incomparable":
        return c["incomparable"][i]
    if cls == "identical":
        return _identical(c, i)
    t = c["position"][i]
    if cls == "post_eos" and c["eos_skip"][i]:
        return _eos_skipped(c, i)
    if cls == "post_eos":
        return (
            f"A emitted EOS (id {c['eos_id'][i]}) at {c['eos_pos'][i]} before the first "
            f"difference at {t}; up to the EOS: {drift_text(c, i, 'sound_')}; both streams complete"
            + (f"; note: {c['note'][i]}" if c["note"][i] else "")
        )
    if cls in ("bf16_tie_flip", "cache_boundary"):
        return _benign_flip(c, i)
    return "; ".join(_failures(c, i)) or "no benign rule applies"


def _identical(c: C, i: int) -> str:
    n = c["compared"][i]
    if c["bitwise"][i]:
        tail = "chosen logprobs bitwise equal"
    elif c["drift_n"][i] == 0:
        tail = "drift not verified: a side stored no logprobs"
    else:
        tail = drift_text(c, i)
    return f"same {n} token ids; {tail} ({c['dtype'][i]}); both streams complete"


def _eos_skipped(c: C, i: int) -> str:
    """At an EOS one side emitted and llama.cpp's ignore_eos skipped (eos_policy.skipped_eos)."""
    by = c["eos_skipped_by"][i]
    x = by.lower()
    return (
        f"{c['eos_skip'][i]}: {by}'s token {c[f'token_{x}'][i]} lies {_dist(c, i, f'below_{x}')} below the EOS "
        f"and is its best non-EOS candidate; moved A->B: token {c['token_a'][i]} {_dist(c, i, 'move_a', True)}, token "
        f"{c['token_b'][i]} {_dist(c, i, 'move_b', True)} <= {_tol(c, i, 'drift', 'move_a')}; {drift_text(c, i)}; "
        f"both streams complete; later positions follow different tokens and are not compared"
    )


def _benign_flip(c: C, i: int) -> str:
    kind = "tie" if c["cls"][i] == "bf16_tie_flip" else "drift"
    head = (
        f"tie on the {c['dtype'][i]} grid"
        if kind == "tie"
        else f"boundaries {c['boundary_a'][i]} vs {c['boundary_b'][i]}, a numeric-size gap on the {c['dtype'][i]} grid"
    )
    return (
        f"{head}: |gap| A {_dist(c, i, 'gap_a')} <= {_tol(c, i, kind, 'gap_a')}, "
        f"B {_dist(c, i, 'gap_b')} <= {_tol(c, i, kind, 'gap_b')}; each chose its own top-1; "
        f"moved A->B: token {c['token_a'][i]} {_dist(c, i, 'move_a', True)}, token {c['token_b'][i]} "
        f"{_dist(c, i, 'move_b', True)} <= {_tol(c, i, 'drift', 'move_a')}; {drift_text(c, i)}"
    )


def _row_texts(c: C, i: int, s: str) -> list[tuple[int, str]]:
    """(flag, what is wrong) for side s's top-k row, with the numbers."""
    g = {k: c[f"{k}_{s}"][i] for k in ("col_lp", "topk_lp", "prob_sum", "max_lp", "unk_above", "dup_id")}
    tok, other = (c["token_a"][i], c["token_b"][i]) if s == "a" else (c["token_b"][i], c["token_a"][i])
    pairs = ((tok, c[f"lg_mine_{s}"][i]), (other, c[f"lg_other_{s}"][i]))
    cand = [f"token {t}: {lg:g}" for t, lg in pairs if not np.isfinite(lg)]
    dup = "an id twice"
    if np.isfinite(g["dup_id"]):
        dup = f"id {int(g['dup_id'])} twice ({_n(c[f'dup_lp1_{s}'][i])}, {_n(c[f'dup_lp2_{s}'][i])})"
    return [
        (COLUMN, f"contradicts its own logprob column for token {tok} ({_n(g['col_lp'])} vs {_n(g['topk_lp'])} nats)"),
        (DUP_ID, f"lists {dup}"),
        (POS_INF, "holds +inf"),
        (POSITIVE_LP, f"holds a logprob above 0 ({g['max_lp']:g})"),
        (SUM_OVER_ONE, f"has probabilities summing to {_n(g['prob_sum'])} (> 1)"),
        (UNKNOWN_ABOVE, f"has an unknown id (-1) {_n(g['unk_above'])} nats above the chosen token"),
        (CAND_LOGIT, f"has logits but none finite for {', '.join(cand) or 'a candidate'}"),
    ]


def _row_failures(c: C, i: int, s: str) -> list[str]:
    bad = int(c[f"row_bad_{s}"][i])
    if not bad:
        return []
    said = [text for flag, text in _row_texts(c, i, s) if bad & flag]
    return [f"{s.upper()}'s top-k row at {c['position'][i]} " + ", ".join(said)]


def _stream_failures(c: C, i: int) -> list[str]:
    out = [f"{s}'s stream {c[f'trunc_{s.lower()}'][i]}" for s in ("A", "B") if c[f"trunc_{s.lower()}"][i]]
    for s in ("a", "b"):
        if not c[f"boundary_valid_{s}"][i]:
            out.append(
                f"{s.upper()}'s cached_tokens {c[f'boundary_{s}'][i]} exceeds its prompt "
                f"({c[f'prompt_len_{s}'][i]} tokens): no boundary"
            )
    return out


def _failures(c: C, i: int) -> list[str]:
    """Every check that failed, most telling first."""
    t, out = c["position"][i], []
    if c["eos_pos"][i] >= 0:
        out += drift_failures(c, i, "sound_", "up to A's EOS")
        if c["eos_refuted"][i]:
            out.append(c["eos_refuted"][i])
    if t >= c["compared"][i]:  # identical ids over the shorter stream, lengths differ
        if c["eos_pos"][i] < 0:
            out.append(
                f"length mismatch: {c['len_a'][i]} vs {c['len_b'][i]} tokens, identical up to {c['compared'][i]}, "
                "no EOS before" + ("" if c["eos_known"][i] else " (EOS ids unknown)")
            )
        return out + _stream_failures(c, i)
    if t < 0:  # same tokens, same length: identical ids, but not sound
        fails = drift_failures(c, i, "", "") + _stream_failures(c, i)
        return [f"same {c['compared'][i]} token ids, but " + f for f in fails] or out
    out += drift_failures(c, i) + _stream_failures(c, i)
    ta, tb = c["token_a"][i], c["token_b"][i]
    for s, o, tok, other in (("A", "B", ta, tb), ("B", "A", tb, ta)):
        x = s.lower()
        out += _row_failures(c, i, x)
        if not c[("b_in_topk_a" if x == "a" else "a_in_topk_b")][i]:
            out.append(f"{o}'s token {other} not in {s}'s top-k (gap >= {_n(abs(c[f'gap_{x}'][i]))} nats)")
        if not c[f"own_in_topk_{x}"][i]:
            out.append(f"{s} chose token {tok}, not in its own top-k (top-1 {c[f'top1_{x}'][i]})")
        elif not c[f"greedy_ok_{x}"][i] and not int(c[f"row_bad_{x}"][i]) & (POS_INF | CAND_LOGIT):
            ulp = c[f"below_{x}_ulp"][i]
            below = f"{_n(ulp)} ulp" if np.isfinite(ulp) and ulp > 0 else f"{_n(c[f'below_{x}'][i])} nats"
            out.append(
                f"{s} chose token {tok}, {below} below its own top-1 {c[f'top1_{x}'][i]} "
                "(greedy: its own top-1, ties allowed)"
            )
        if not c[f"agree_ok_{x}"][i]:
            lg = c[f"gap_{x}"][i] + c[f"agree_{x}"][i]
            out.append(
                f"{s}'s logits and logprobs disagree: logit gap {_n(lg)}, logprob gap {_n(c[f'gap_{x}'][i])} nats "
                f"(differ by {_n(abs(c[f'agree_{x}'][i]))} > {_n(c[f'agree_tol_{x}'][i])})"
            )
    for x, tok in (("a", ta), ("b", tb)):
        if not ((c["b_in_topk_a"][i] and c["a_in_topk_b"][i]) and not c[f"move_ok_{x}"][i]):
            continue
        ulp, lse = c[f"move_{x}_ulp"][i], c[f"lse_{x}"][i]
        if np.isfinite(ulp) and abs(ulp) <= c["tol_drift_ulps"][i]:  # the logit stayed, the logprob did not
            out.append(
                f"token {tok}'s logprob moved {_signed(c[f'move_{x}'][i])} nats from A to B while its logit "
                f"moved {_signed(ulp)} ulp (the normaliser shifted {_n(abs(lse))} nats > "
                f"{_n(c[f'lse_tol_{x}'][i])} = {c['tol_drift_ulps'][i]:g} ulp here, {c['dtype'][i]})"
            )
        else:
            out.append(
                f"token {tok} moved {_dist(c, i, f'move_{x}', True)} from A to B "
                f"(> {_tol(c, i, 'drift', f'move_{x}')}, {c['dtype'][i]})"
            )
    if c["b_in_topk_a"][i] and c["a_in_topk_b"][i] and not (c["tie_ok_a"][i] and c["tie_ok_b"][i]):
        gaps = f"|gap| A {_dist(c, i, 'gap_a')}, B {_dist(c, i, 'gap_b')}"
        ba, bb = (str(x) if x >= 0 else "?" for x in (c["boundary_a"][i], c["boundary_b"][i]))
        dt = c["dtype"][i]
        if c["boundary_differs"][i]:
            if not (c["num_ok_a"][i] and c["num_ok_b"][i]):
                tol = _tol(c, i, "drift", "gap_a")
                out.append(f"{gaps} beyond the drift tolerance {tol} ({dt}; boundaries {ba} vs {bb})")
        else:
            why = "unknown" if "?" in (ba, bb) else "equal"
            if not (c["boundary_valid_a"][i] and c["boundary_valid_b"][i]):
                why = "not valid"
            tol = _tol(c, i, "tie", "gap_a")
            out.append(f"{gaps} beyond the tie tolerance {tol} ({dt}), boundaries {why} ({ba} vs {bb})")
    if c["note"][i]:
        out.append(f"note: {c['note'][i]}")
    return out
