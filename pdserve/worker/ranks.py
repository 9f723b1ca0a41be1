"""A worker process's place among its instance's tensor-parallel ranks: the process group (gloo on a CPU,
NCCL on CUDA, met through a file in the engine's socket folder), its device, and on a CPU its own cores.

vLLM's CPU build binds one OpenMP thread set per rank (VLLM_CPU_OMP_THREADS_BIND); ours splits the cores the
instance may use (its affinity, which `pdserve launch` sets) into one contiguous share per rank, so two
ranks never compute on one core. Fewer cores than ranks: the ranks share them.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch

from pdserve.kernels import cpu_ops
from pdserve.model.tensor_parallel import TensorParallel
from pdserve.utils.cores import core_share, my_cores
from pdserve.worker.shm_all_reduce import ShmAllReduce

log = logging.getLogger("pdserve.worker")
GLOO_ENV = "PDSERVE_TP_GLOO"  # "1": all-reduce over gloo even where the shared-memory one is built (comparisons)


def bind_cores(rank: int, ranks: int) -> list[int]:
    """Pin this process (and torch's threads) to its share of the instance's cores."""
    mine = core_share(my_cores(), rank, ranks)
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine


def join_ranks(rank: int, ranks: int, rendezvous: str, device: str | None, timeout: float) -> TensorParallel:
    """Join the instance's process group (every rank calls it at start); a lone rank joins nothing."""
    if ranks == 1:
        return TensorParallel()
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        log.info("tensor-parallel rank %d of %d on cores %s", rank, ranks, bind_cores(rank, ranks))
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank,
                                         world_size=ranks, timeout=datetime.timedelta(seconds=timeout))
    shm = None if cuda else shm_all_reduce(rank, ranks)
    return TensorParallel(rank, ranks, reduce=shm, gather=shm.gather_to_first if shm is not None else None)


def shm_all_reduce(rank: int, ranks: int) -> ShmAllReduce | None:
    """The shared-memory all-reduce when the CPU kernels are built (every rank decides alike); else gloo."""
    ops = cpu_ops()
    if ops is None or os.environ.get(GLOO_ENV) == "1":
        log.info("tensor-parallel all-reduce over gloo")
        return None
    return ShmAllReduce(rank, ranks, ops)


def leave_ranks(tp: TensorParallel) -> None:
    if isinstance(tp.reduce, ShmAllReduce):
        tp.reduce.close()
    if tp.size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
