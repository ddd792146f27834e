"""Every headline ratio of the benches against its target, in one table (issue 25).

Runs each bench as a subprocess (`--json`, and `--quick` with --quick), reads its JSON and
prints one row per headline ratio: bench, key, value, target, met. The ratios are each bench's
own, measured side by side inside it (docs: the bench's docstring, bench/RESULTS.md); this
script only collects them. A bench that fails prints its row as `failed` with its last error
line, and the others still run. Exit 0 unless a bench failed: a missed target is a figure to
look at (and to record in bench/RESULTS.md, one row per measurement), never an error, so CI runs
this for crashes only (tests/bench/test_bench_quick.py).

    python bench/run_all.py [--quick] [--only capture,store] [--json] [--out results.json] [--record]

--record adds the rows to bench/RESULTS.md's headline log (newest first: date, commit, machine
and load, bench, key, value, target, command), so a regression is a line there, not a memory.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# bench -> (script, quick argv, full argv, [(key, op, target)]): the headline ratios of issue 25
# and the store's; op "<=" or ">=" says which side meets the target.
BENCHES: dict[str, tuple[str, list[str], list[str], list[tuple[str, str, float]]]] = {
    "capture": ("capture_bench.py", ["--quick"], [], [("cpu_per_token_vs_bare_c64", "<=", 1.3)]),
    "diff": (
        "diff_bench.py",
        ["--quick"],
        [],
        [("speedup_vs_per_position", ">=", 30.0), ("vs_read_floor", "<=", 1.2)],
    ),
    "diagnostic": ("diagnostic_bench.py", ["--quick"], [], [("vs_independent_forwards", "<=", 0.9)]),
    "engine": ("engine_bench.py", ["--quick", "--repeats", "1"], [], [("speedup_c8", ">=", 4.0)]),
    "store": (
        "store_bench.py",
        ["--quick"],
        [],
        [("read_vs_npy", "<=", 2.0), ("bytes_vs_raw", "<=", 1.2), ("checksum_read_cost", "<=", 2.0)],
    ),
}


def parse_json(stdout: str) -> dict:
    """The bench's JSON object: the whole output, else its last line that is one."""
    try:
        return json.loads(stdout)
    except ValueError:
        pass
    for line in reversed(stdout.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    raise ValueError("no JSON object in the bench's output")


def run_bench(name: str, quick: bool, timeout_s: float) -> dict:
    script, quick_args, full_args, _ = BENCHES[name]
    cmd = [sys.executable, str(ROOT / "bench" / script), "--json", *(quick_args if quick else full_args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s:g} s", "seconds": round(time.perf_counter() - t0, 1)}
    out = {"command": " ".join(["python", f"bench/{script}", *cmd[3:]]), "seconds": round(time.perf_counter() - t0, 1)}
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return {**out, "error": f"exit {r.returncode}: {last[:200]}"}
    try:
        return {**out, "result": parse_json(r.stdout)}
    except ValueError as e:
        return {**out, "error": str(e)}


def rows(name: str, got: dict) -> list[dict]:
    """One row per headline key of the bench."""
    out = []
    for key, op, target in BENCHES[name][3]:
        row = {"bench": name, "key": key, "target": f"{op} {target:g}", "value": None, "met": None}
        if "error" in got:
            row["error"] = got["error"]
        else:
            v = got["result"].get(key)
            if isinstance(v, (int, float)):
                row["value"] = round(float(v), 3)
                row["met"] = v <= target if op == "<=" else v >= target
            else:
                row["error"] = f"the bench printed no {key!r}"
        out.append(row)
    return out


RESULTS = ROOT / "bench" / "RESULTS.md"
LOG_HEADER = "| date (UTC) | commit | machine (load) | bench | key | value | target | met | command |"


def record(doc: dict, path: Path = RESULTS) -> int:
    """Insert one row per measured ratio under LOG_HEADER's separator (newest first)."""
    lines = path.read_text().splitlines()
    if LOG_HEADER not in lines:
        raise SystemExit(f"{path}: no headline log table (its header line: {LOG_HEADER})")
    at = lines.index(LOG_HEADER) + 2  # after the |---| line
    machine = f"{doc['cpus']} CPUs ({doc['load_1m']})"
    new = []
    for r in doc["rows"]:
        if r.get("error"):
            continue
        cmd = doc["benches"][r["bench"]].get("command", "")
        met = "yes" if r["met"] else "no"
        new.append(
            f"| {doc['date_utc']} | {doc['commit']} | {machine} | {r['bench']} | `{r['key']}` | {r['value']:g} "
            f"| {r['target']} | {met} | `{cmd}` |"
        )
    path.write_text("\n".join(lines[:at] + new + lines[at:]) + "\n")
    return len(new)


def git_commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], capture_output=True, text=True, cwd=ROOT)
        return (r.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="each bench's smallest mode (a few minutes on 2 cores)")
    ap.add_argument("--only", help=f"comma-separated benches of {', '.join(BENCHES)}")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per bench")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", help="also write the JSON object (rows + every bench's own JSON) here")
    ap.add_argument("--record", action="store_true", help="add the rows to bench/RESULTS.md's headline log")
    a = ap.parse_args()
    names = [n.strip() for n in a.only.split(",")] if a.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"--only: unknown bench {unknown[0]!r}; known: {', '.join(BENCHES)}")
    table, results = [], {}
    for name in names:
        print(f"run_all: {name} ...", file=sys.stderr, flush=True)
        results[name] = run_bench(name, a.quick, a.timeout_s)
        table += rows(name, results[name])
    doc = {
        "commit": git_commit(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "quick": a.quick,
        "load_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "rows": table,
        "benches": results,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    if a.record:
        print(f"run_all: {record(doc)} rows added to {RESULTS}", file=sys.stderr)
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"commit {doc['commit']}  {doc['date_utc']} UTC  load {doc['load_1m']} on {doc['cpus']} CPUs")
        print("| bench | key | value | target | met |")
        print("|---|---|---|---|---|")
        for r in table:
            value = r["error"] if r.get("error") else f"{r['value']:g}"
            met = "failed" if r.get("error") else ("yes" if r["met"] else "no")
            print(f"| {r['bench']} | {r['key']} | {value} | {r['target']} | {met} |")
    return 1 if any(r.get("error") for r in table) else 0


if __name__ == "__main__":
    sys.exit(main())
