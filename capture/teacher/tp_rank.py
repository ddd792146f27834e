"""`--tp N`, inside one rank: the process that tp.launch starts, once a rank.

`main` is the rank's entry point and the only place that learns which rank this is: it reads
the spec file named on its command line (this rank's `Rank`, the run's `TeacherConfig`, where to
write its result), initializes torch.distributed for that rank, and runs the very same
diagnostic with the rank passed down explicitly (run.run_teacher -> DiagnosticConfig.rank ->
load_model, run metadata, who writes). Nothing below it reads the environment. torch is
imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

from tracekit.errors import TracekitError

from .config import TeacherConfig
from .records import Rank
from .run import run_teacher


def main(argv: list[str]) -> int:
    """One rank: argv is [spec file]; run the diagnostic on its config, write this rank's result."""
    spec = json.loads(Path(argv[0]).read_text())
    rank = Rank.from_dict(spec["rank"])
    cfg = TeacherConfig(**spec["config"])
    out = Path(spec["result"])
    _init_process_group(rank)
    try:
        summary = run_teacher(cfg, rank)
    except TracekitError as e:
        out.write_text(json.dumps({"error": str(e)}))
        return 3
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    out.write_text(json.dumps({"summary": summary.as_dict()}))
    return 0


def _init_process_group(rank: Rank) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    kw = {}
    on_cuda = rank.device.startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(torch.device(rank.device))
        if rank.backend == "nccl":
            kw["device_id"] = torch.device(rank.device)
    dist.init_process_group(rank.backend, rank=rank.index, world_size=rank.world, timeout=timedelta(minutes=30), **kw)
    if rank.backend == "gloo" and on_cuda:
        _plain_all_gather()


def _plain_all_gather() -> None:
    """gloo with CUDA tensors: torch 2.11's functional all-gather (what DTensor's redistribute
    calls, e.g. for the LM head's `colwise_gather_output`) segfaults in wait_tensor on an H200,
    while the plain `all_gather_into_tensor` on the same tensors works. Route the functional call
    through the plain one: a gather copies, it does no arithmetic, so the logits are the same."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    def gather(self, gather_dim, group, tag=""):
        pg = c10d._resolve_process_group(funcol._resolve_group_name(group, tag))
        n = dist.get_world_size(pg)
        src = self.contiguous()
        out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
        dist.all_gather_into_tensor(out, src, group=pg)
        return out if gather_dim == 0 else torch.cat(out.chunk(n, dim=0), dim=gather_dim)

    funcol.all_gather_tensor = gather
    if hasattr(funcol, "all_gather_single"):
        funcol.all_gather_single = gather
