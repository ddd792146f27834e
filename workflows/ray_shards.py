"""A matrix's shards as Ray tasks (docs/runner.md, "Ray"), then the merged report.

One task per shard, each `tracekit run MATRIX --out OUT/shard-I --shard I/N` in its own
process, reserving `--gpus-per-shard` GPUs of the cluster (Ray sets CUDA_VISIBLE_DEVICES for
the task, so the shard's engines land on its GPUs). A shard that fails (exit 3, killed) is
reported with its exit code and its last stderr line; the other shards' directories are
kept and merged as they are (the report names what is missing). Rerun with --resume: every
shard resumes, the finished ones in seconds.

    ray job submit --working-dir . -- \\
        python -m tracekit.workflows.ray_shards M.toml --out runs/m --shards 8 --gpus-per-shard 1

Ray is an optional extra (`pip install 'tracekit-llm[ray]'`); nothing else imports it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def shard_dir(out: Path, i: int) -> Path:
    return out / f"shard-{i}"


def _run_one(matrix: str, out: str, i: int, n: int, resume: bool) -> dict:
    """Body of one Ray task: the shard as a `tracekit run` process on the task's node."""
    d = shard_dir(Path(out), i)
    cmd = [sys.executable, "-m", "tracekit", "run", matrix, "--out", str(d), "--shard", f"{i}/{n}"]
    if resume or (d / "shard.json").is_file():  # a rerun of the job resumes every shard
        cmd.append("--resume")
    p = subprocess.run(cmd, capture_output=True, text=True)
    last = (p.stderr.strip().splitlines() or [""])[-1]
    return {"index": i, "dir": str(d), "returncode": p.returncode, "last_line": last, "node": os.uname().nodename}


def run_shards(matrix, out, shards: int, gpus_per_shard: float = 0, cpus_per_shard: float = 1, resume=False):
    """Run every shard as a Ray task on the connected cluster (ray.init first); returns one
    record per shard (index, dir, returncode, last stderr line, node), by index."""
    import ray

    task = ray.remote(num_gpus=gpus_per_shard, num_cpus=cpus_per_shard, max_retries=0)(_run_one)
    matrix, out = str(Path(matrix).resolve()), Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    refs = [task.remote(matrix, str(out), i, shards, resume) for i in range(shards)]
    return sorted(ray.get(refs), key=lambda r: r["index"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tracekit.workflows.ray_shards", description=__doc__.split("\n")[0])
    ap.add_argument("matrix")
    ap.add_argument("--out", required=True, help="OUT/shard-I per shard, OUT/merged for the merged run")
    ap.add_argument("--shards", type=int, required=True)
    ap.add_argument("--gpus-per-shard", type=float, default=0)
    ap.add_argument("--cpus-per-shard", type=float, default=1)
    ap.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else a local one)")
    ap.add_argument("--num-cpus", type=int, default=None, help="a local cluster's CPUs")
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    if a.shards < 1:
        ap.error("--shards must be >= 1")
    import ray

    root = str(Path(__file__).resolve().parents[1])  # the checkout, for workers of a local cluster
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    ray.init(address=a.address, num_cpus=a.num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        recs = run_shards(a.matrix, a.out, a.shards, a.gpus_per_shard, a.cpus_per_shard, a.resume)
    finally:
        ray.shutdown()
    for r in recs:
        state = {0: "all cells pass", 1: "some cell fails"}.get(r["returncode"], f"FAILED (exit {r['returncode']})")
        print(f"shard {r['index']}/{a.shards} on {r['node']}: {state}: {r['last_line']}", file=sys.stderr)
    dirs = [r["dir"] for r in recs if (Path(r["dir"]) / "shard.json").is_file()]
    if not dirs:
        print("Error: no shard started; nothing to merge", file=sys.stderr)
        return 3
    merged = Path(a.out) / "merged"
    if merged.exists():
        import shutil

        shutil.rmtree(merged)  # derived from the shards, rebuilt on every run of the job
    p = subprocess.run([sys.executable, "-m", "tracekit", "report", *dirs, "--out", str(merged)])
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
