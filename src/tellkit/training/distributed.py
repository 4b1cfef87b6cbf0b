"""Process-group set-up from ``torchrun``'s environment, and the few collectives the loop uses.

Single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``): every helper is a no-op. Under
``torchrun --nproc_per_node N``: NCCL on CUDA (one GPU per process, ``LOCAL_RANK``), gloo on CPU.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tellkit.utils.precision import resolve_device


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # True when we called init_process_group (and must destroy it)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (in rank order), on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def setup(device: str | None = None) -> DistInfo:
    """Read torchrun's variables, pick the device, start the process group when needed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    dev = resolve_device(device)  # None: the GPU when there is one; one line for an unknown or missing device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    info = DistInfo(rank=rank, world=world, local_rank=local_rank, device=dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        info.owns_group = True
    return info


def teardown(info: DistInfo) -> None:
    if info.owns_group and dist.is_initialized():
        # every rank reaches this point before any rank tears its transport down: a rank that
        # destroys the group while a peer still talks to it can abort the peer (gloo:
        # "terminate called without an active exception", SIGABRT after all work was done)

        gc.collect()  # free DDP reducers / pending work kept alive by reference cycles while Python is whole
        dist.barrier()
        dist.destroy_process_group()
