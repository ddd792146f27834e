"""Turn a history's logits into trace token columns (one TokenColumns a sequence).

Log-probabilities are computed in FP32 from the logits the model produced in
its own dtype (the cast to FP32 is exact), so a BF16 row carries BF16 logits
and their exact log-softmax, not a second rounding.
"""

from __future__ import annotations

import numpy as np

from tracekit.schema import TokenColumns


def score(logits, targets, topk: int, full_logits: bool = False) -> list[TokenColumns]:
    """logits: [N, G, V] tensor (any float dtype); targets: [N, G] long tensor of
    the teacher-forced token ids. Returns N TokenColumns of G rows each."""
    import torch

    with torch.inference_mode():
        x = logits.float()  # [N, G, V] fp32
        logp = torch.log_softmax(x, dim=-1)  # [N, G, V]
        chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N, G]
        k = min(topk, x.shape[-1])
        top_logit, top_id = torch.topk(x, k, dim=-1)  # [N, G, k], sorted descending
        top_logp = logp.gather(-1, top_id)

        def cpu(t):
            return t.cpu().numpy()

        token_id, chosen, top_id, top_logp, top_logit = map(cpu, (targets, chosen, top_id, top_logp, top_logit))
        full = cpu(x) if full_logits else None
    n, g = token_id.shape
    nan_times = np.full(g, np.nan)
    return [
        TokenColumns(
            token_id[i],
            chosen[i],
            nan_times,
            top_id[i],
            top_logp[i],
            top_logit[i],
            full[i] if full is not None else None,
        )
        for i in range(n)
    ]
