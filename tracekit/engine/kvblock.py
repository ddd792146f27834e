"""`Block`: one prefix-cache block's KV, per layer.

Its own module so that both the prefix cache (which stores blocks) and the injected faults
(which serve altered copies of them) can import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only; the engine imports torch where it runs a model
    import torch


@dataclass
class Block:
    keys: list[torch.Tensor]  # per layer [Hkv, block_size, D]
    values: list[torch.Tensor]  # per layer [Hkv, block_size, D]
