"""`--tp N`, the launcher: the diagnostic's histories and dtypes under transformers'
own tensor-parallel plan, one process a rank.

The calling process checks what it can before any rank starts (the
architecture has a plan, N divides the head counts and the vocabulary, the
backend exists, there are GPUs for it), then starts N fresh interpreters running
`tp_rank.main` with torchrun's environment on 127.0.0.1 and a free port, each
given its own spec file (its Rank and the run's TeacherConfig) on the command
line, and collects their results. Each rank (tp_rank.py) initializes
torch.distributed (gloo on CPU, nccl on CUDA, or `--tp-backend`), loads the model with `tp_plan="auto"` (through
`DistributedConfig` where transformers has it) and runs the very same
diagnostic: the same sequences, batches and forwards on every rank, because
each forward's collectives need all of them. Rank 0 writes the trace and its
summary; the others write nothing.

It does not split anything by hand (the plan is the model's
`base_model_tp_plan`), does not do pipeline or data parallelism, and runs
`decode` steps eagerly (no CUDA graphs under TP). torch is imported lazily.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from tracekit.errors import ConfigError, TracekitError

from .config import TeacherConfig, hf_config
from .records import DiagnosticSummary, Rank

BACKENDS = ("gloo", "nccl")
REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder holding capture/, for the ranks' sys.path


@dataclass(frozen=True)
class TPSetup:
    """What the launcher starts: N ranks, their backend, device type and devices."""

    tp: int
    backend: str  # gloo | nccl
    device_type: str  # cpu | cuda
    devices: tuple[int, ...]  # per rank: the CUDA device index (LOCAL_RANK); () on CPU

    def rank_device(self, rank: int) -> str:
        return f"cuda:{self.devices[rank]}" if self.devices else "cpu"

    def rank(self, index: int) -> Rank:
        """What rank `index` is told about itself (tp_rank.main reads it from its spec file)."""
        return Rank(index, self.tp, self.backend, tuple(self.rank_device(r) for r in range(self.tp)))


# ---- checks before any rank starts ---------------------------------------------------------------


def check(model_dir: str, tp: int, device: str, backend: str | None) -> TPSetup:
    """Everything `--tp N` needs that can be known before starting the ranks; a ConfigError says
    what is missing and what to do."""
    import importlib.util

    if device == "auto" or device.startswith("cuda:"):
        raise ConfigError(
            f"--tp {tp} places rank r on cuda:r: pass --device cuda (choose the GPUs with "
            f"CUDA_VISIBLE_DEVICES) or --device cpu, not --device {device}"
        )
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: expected cpu or cuda with --tp")
    device_type = device
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise ConfigError(f"--tp-backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    devices = _check_backend(tp, device_type, backend)
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            f"--tp {tp}: transformers' tensor-parallel loading needs the accelerate package "
            "(pip install accelerate), or run with --tp 1"
        )
    check_plan(model_dir, tp)
    return TPSetup(tp, backend, device_type, devices)


def _check_backend(tp: int, device_type: str, backend: str) -> tuple[int, ...]:
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError(f"--tp {tp}: this torch build ({torch.__version__}) has no torch.distributed")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--tp {tp} --device cuda: no CUDA device is visible to torch; use --device cpu")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError(f"--tp {tp}: this torch build has no gloo backend; on CUDA use --tp-backend nccl")
    if backend == "nccl":
        if device_type != "cuda":
            raise ConfigError("--tp-backend nccl runs on CUDA only: pass --device cuda, or use gloo on CPU")
        if not dist.is_nccl_available():
            raise ConfigError(f"--tp {tp}: this torch build has no NCCL; pass --tp-backend gloo")
    if device_type == "cpu":
        return ()
    n = torch.cuda.device_count()
    if backend == "nccl" and n < tp:
        raise ConfigError(
            f"--tp {tp} with nccl needs {tp} GPUs (one a rank), torch sees {n}: pass --tp-backend gloo "
            f"to run the {tp} ranks on the {n} GPU(s) there are, or a smaller --tp"
        )
    return tuple(r % n for r in range(tp))  # gloo with fewer GPUs than ranks: ranks share them


def check_plan(model_dir: str, tp: int) -> None:
    """The architecture has a tensor-parallel plan in this transformers, and tp divides what the plan
    splits: the attention and key/value heads (q/k/v are split by columns, a whole number of heads a
    rank) and the vocabulary (the LM head's columns, gathered)."""
    import transformers

    cfg, text = hf_config(model_dir)
    plan = getattr(text, "base_model_tp_plan", None) or getattr(cfg, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"--tp {tp}: transformers {transformers.__version__} has no tensor-parallel plan for "
            f"{cfg.model_type} ({type(text).__name__}.base_model_tp_plan is empty); run it with --tp 1"
        )
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    vocab = int(text.vocab_size)
    if heads % tp or kv % tp or vocab % tp:
        fits = [d for d in range(1, heads + 1) if not (heads % d or kv % d or vocab % d)]
        raise ConfigError(
            f"--tp {tp}: the model has {heads} attention heads, {kv} key/value heads and a vocabulary of "
            f"{vocab}; tp must divide all three (here --tp {' or '.join(map(str, fits))})"
        )


# ---- the launcher --------------------------------------------------------------------------------


def launch(setup: TPSetup, cfg: TeacherConfig) -> DiagnosticSummary:
    """Start the ranks on `cfg`, wait for all of them, and return rank 0's DiagnosticSummary.
    A rank's TracekitError comes back as the same error; a rank that dies otherwise stops the
    others (a rank alone would wait in a collective)."""
    with tempfile.TemporaryDirectory(prefix="tracekit-tp-") as tmp:
        port = _free_port()
        procs = [_start(setup, r, _write_spec(setup, r, cfg, Path(tmp)), Path(tmp), port) for r in range(setup.tp)]
        failed = _wait_all(procs)
        results = [_result(Path(tmp), r) for r in range(setup.tp)]
        errors = [(r, x) for r, x in enumerate(results) if "error" in x]
        if errors:
            raise ConfigError(errors[0][1]["error"])
        if failed is not None:
            raise _rank_failed(Path(tmp), setup.tp, *failed)
        return DiagnosticSummary.from_dict(results[0]["summary"])


def _write_spec(setup: TPSetup, rank: int, cfg: TeacherConfig, tmp: Path) -> Path:
    """Rank `rank`'s spec file: everything it runs on, and where it writes its result."""
    spec = tmp / f"spec{rank}.json"
    result = tmp / f"result{rank}.json"
    spec.write_text(json.dumps({"rank": setup.rank(rank).as_dict(), "config": asdict(cfg), "result": str(result)}))
    return spec


def _rank_failed(tmp: Path, tp: int, rank: int, code: int) -> TracekitError:
    """The error of a rank that died without a TracekitError; its last lines go to stderr
    (rank 0 wrote there already)."""
    log = tmp / f"rank{rank}.log"
    tail = log.read_text(errors="replace").strip().splitlines()[-20:] if log.exists() else []
    for line in tail:
        print(f"[rank{rank}] {line}", file=sys.stderr)
    shown = "rank 0's output is above" if rank == 0 else f"rank 0's output and rank {rank}'s last lines are above"
    detail = f" ({tail[-1][:200]})" if tail else ""
    return TracekitError(f"--tp {tp}: rank {rank} exited with status {code}{detail}; the others were stopped ({shown})")


def _free_port() -> int:
    """A port free now on 127.0.0.1 (torchrun's way: another process could take it before rank 0
    binds it; then the run fails at init and a second try gets another port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(setup: TPSetup, rank: int, spec: Path, tmp: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(setup.devices[rank] if setup.devices else rank),  # the device transformers binds
            "WORLD_SIZE": str(setup.tp),
            "LOCAL_WORLD_SIZE": str(setup.tp),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        }
    )
    if setup.device_type == "cpu":
        # transformers picks the mesh's device type from the machine's accelerator: hide GPUs
        # from a CPU run; and share the cores instead of each rank taking all of them.
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // setup.tp)))
    if setup.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env:
        lo = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
        if lo:  # every rank is on this host: loopback, whatever the hostname resolves to
            env["GLOO_SOCKET_IFNAME"] = lo[0]
    # the spec file's path is the rank's one argument: read once, at its entry point (tp_rank.main)
    entry = "import sys; from tracekit.capture.teacher.tp_rank import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", entry, str(spec)]
    # stdout stays data (the CLI's summary): rank 0's output goes to stderr, the others' to a log
    if rank == 0:
        err = _stderr_fd()
        return subprocess.Popen(cmd, env=env, stdout=err if err is not None else subprocess.DEVNULL, stderr=err)
    log = open(tmp / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed with the process, below)
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()  # the child holds its own copy
    return p


def _stderr_fd() -> int | None:
    """This process's stderr as a file descriptor, or None (inherit) where sys.stderr has none."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def _wait_all(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait for every rank; at the first that fails, stop the others. Returns (rank, status) of
    the first failure, or None."""
    done: queue.Queue = queue.Queue()
    for r, p in enumerate(procs):
        threading.Thread(target=lambda r=r, p=p: done.put((r, p.wait())), daemon=True).start()
    failed = None
    try:
        for _ in procs:
            r, code = done.get()
            if code != 0 and failed is None:
                failed = (r, code)
                _stop(procs)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    return failed


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _result(tmp: Path, rank: int) -> dict:
    f = tmp / f"result{rank}.json"
    return json.loads(f.read_text()) if f.exists() else {}
