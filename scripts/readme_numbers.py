"""The numbers the README quotes, generated from runs, never hand-typed (issue 24 item 16).

    python scripts/readme_numbers.py --demo traces/demo --matrix traces/cpu-small            # print the blocks
    python scripts/readme_numbers.py --demo traces/demo --matrix traces/cpu-small --write README.md
    python scripts/readme_numbers.py --demo traces/demo --matrix traces/cpu-small --check README.md

The README holds each generated block between `<!-- readme-numbers:NAME -->` and
`<!-- /readme-numbers:NAME -->`; `--write` replaces every block's body with what the runs give,
`--check` exits 1 (naming the block) when a body differs. The blocks:

- `demo-run`: how long the demo took and how much it wrote (its page's "took N s", the files under DIR);
- `demo-page`: the demo page's cell table, its verdict lines and the calibrations it was judged with
  (DIR/report/demo_stdout.txt, as `tracekit demo` printed it);
- `demo-example`: the first batch-composition cause line of the page;
- `demo-noise`: the first `calibrated_noise` cause line (a near-tie no sampled run tipped, within the
  calibration's healthy flips), or that the run had none;
- `fault`: the fault cell of a `tracekit run fixtures/matrix/cpu_small.toml` run (its
  report/summary.json): identical count, unexplained pairs, the ULP gaps at their divergences, the
  failed checks.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BLOCK = re.compile(
    r"(<!-- readme-numbers:(?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- /readme-numbers:(?P=name) -->)", re.S
)
VERDICT_HEADS = ("FP32 control", "BF16:", "Deterministic configuration", "Causes (", "LOUD", "FAIL")


def _page(demo: Path) -> list[str]:
    p = demo / "report" / "demo_stdout.txt"
    if not p.is_file():
        raise SystemExit(f"{p}: missing; run `tracekit demo --out {demo}` first")
    return p.read_text(encoding="utf-8").splitlines()


def demo_run(demo: Path) -> str:
    took = next((ln for ln in _page(demo) if re.fullmatch(r"took \d+ s", ln)), None)
    size = sum(f.stat().st_size for f in demo.rglob("*") if f.is_file())
    return f"{took.removeprefix('took ') if took else 'unknown time'}, {size / 1e6:.1f} MB"


def demo_page(demo: Path) -> str:
    lines = _page(demo)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("cell "))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    table = [ln.rstrip() for ln in lines[start:end]]
    verdict = [ln for ln in lines if ln.startswith(VERDICT_HEADS)]
    cals = [ln for ln in lines if ln.startswith("- `calibration/")]
    return "\n".join(["```", *table, "...", *cals, *verdict, "```"]) + "\n"


def demo_example(demo: Path) -> str:
    line = next((ln for ln in _page(demo) if "cause: batch composition" in ln), None)
    return (f"`{line}`" if line else "(no batch-composition flip in this run)") + "\n"


def demo_noise(demo: Path) -> str:
    line = next((ln for ln in _page(demo) if "cause: this engine's calibrated noise" in ln), None)
    return (f"`{line}`" if line else "(no pair of this run needed it: every flip was reproduced)") + "\n"


def fault(matrix: Path) -> str:
    p = matrix / "report" / "summary.json"
    if not p.is_file():
        raise SystemExit(f"{p}: missing; run `tracekit run fixtures/matrix/cpu_small.toml --out {matrix}` first")
    doc = json.loads(p.read_text(encoding="utf-8"))
    out = []
    for c in doc["cells"]:
        if c["verdict"] != "fail":
            continue
        bad = [q for q in c["divergent"] if q["class"] == "unexplained"]
        ulps = [u for q in bad for u in (q["gap_a_ulp"], q["gap_b_ulp"]) if u is not None]
        outside = sum(q["gap_a_ulp"] is None or q["gap_b_ulp"] is None for q in bad)
        gaps = f"gaps of {min(ulps):.3g}–{max(ulps):.3g} ULPs" if ulps else "no ULP gap"
        if outside:
            gaps += f", {outside} with a token outside the other side's top-k"
        checks = ", ".join(f"`{k}`" for k in c["failed_checks"]) or "none"
        out.append(
            f"`{c['id']}`: {c['equality']} identical with {len(bad)} `unexplained` pairs ({gaps}); "
            f"failed checks: {checks}"
        )
    t = doc["totals"]
    head = f"{t['passed']}/{t['cells']} cells pass (`{doc['matrix']['name']}`, {doc['tool']}"
    head += f", commit {doc['git_commit'][:12]})" if doc.get("git_commit") else ")"
    return "\n".join([head + ":", *[f"- {x}" for x in out]]) + "\n"


def blocks(demo: Path | None, matrix: Path | None) -> dict[str, str]:
    out = {}
    if demo is not None:
        out |= {"demo-run": demo_run(demo) + "\n", "demo-page": demo_page(demo), "demo-example": demo_example(demo)}
        out["demo-noise"] = demo_noise(demo)
    if matrix is not None:
        out["fault"] = fault(matrix)
    return out


def apply(text: str, made: dict[str, str]) -> tuple[str, list[str]]:
    """(the text with every known block's body replaced, the names whose body changed)."""
    changed = []

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in made:
            return m.group(0)
        if m.group("body") != made[name]:
            changed.append(name)
        return m.group(1) + made[name] + m.group(4)

    return BLOCK.sub(sub, text), changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", type=Path, help="a `tracekit demo` run directory (e.g. traces/demo)")
    ap.add_argument("--matrix", type=Path, help="a `tracekit run fixtures/matrix/cpu_small.toml` run directory")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", type=Path, help="replace the README's blocks with the generated ones")
    g.add_argument("--check", type=Path, help="exit 1 when the README's blocks differ from the generated ones")
    a = ap.parse_args(argv)
    made = blocks(a.demo, a.matrix)
    if not made:
        ap.error("give --demo DIR and/or --matrix DIR")
    target = a.write or a.check
    if target is None:
        for name, body in made.items():
            print(f"<!-- readme-numbers:{name} -->\n{body}<!-- /readme-numbers:{name} -->")
        return 0
    text = target.read_text(encoding="utf-8")
    missing = [n for n in made if f"<!-- readme-numbers:{n} -->" not in text]
    if missing:
        print(f"{target}: no block(s) {', '.join(missing)}", file=sys.stderr)
        return 1
    new, changed = apply(text, made)
    if a.write:
        target.write_text(new, encoding="utf-8")
        print(f"{target}: {len(changed)} block(s) rewritten ({', '.join(changed) or 'none changed'})", file=sys.stderr)
        return 0
    if changed:
        print(f"{target}: block(s) {', '.join(changed)} differ from the run; rerun with --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
