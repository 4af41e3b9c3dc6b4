"""Multi-process training under ``torchrun``: process group, DDP / FSDP2 wrapping, reductions, consistency.

Each process joins one group from torchrun's environment (``gloo`` on CPU, ``nccl`` on CUDA with GPU
``LOCAL_RANK``); with one process every helper is a no-op, so the loop has one path. What a recipe means for
FSDP2 is the recipe's (:meth:`mixprec.precision.Recipe.fsdp_policy`); this module holds no precision knowledge.

Guarantees: N ranks x batch B train the same model as one process x batch N*B, up to summation order (and bf16
rounding under bf16-mixed): :class:`~mixprec.train.data.loaders.BatchLoader` strides one permutation per
``(seed, epoch)`` over ranks and pads shards to equal length; every rank seeds the same RNG. Every rank skips
the same steps, holds the same scale and stops at the same step (``found_inf`` and non-finite flags are
all-reduced); :func:`check_consistency` proves it every N steps. Checkpoints are one file written by rank 0
(:func:`state_dicts`, every rank's running losses via :func:`rows_over_ranks`); resuming needs the same world
size and strategy. Out of memory is local to a rank: :func:`stop_alone` / :func:`peer_stop`.
BatchNorm running statistics under FSDP stay per rank. See docs/architecture.md, "Distributed".
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import signal
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..memory import local_tensor

__all__ = [
    "DistEnv",
    "RankDivergenceError",
    "setup",
    "resolve_strategy",
    "teardown",
    "wrap_model",
    "unwrap",
    "no_sync",
    "barrier",
    "all_reduce_sum",
    "mean_over_ranks",
    "max_over_ranks",
    "rows_over_ranks",
    "eval_shard",
    "state_dicts",
    "load_state_dicts",
    "check_consistency",
    "local_tensor",
    "stop_alone",
    "peer_stop",
]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_owns_process_group = False  # True when setup() created the group (teardown() then destroys it)
_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


class RankDivergenceError(RuntimeError):
    """Ranks that must agree (loss scale, skipped steps, replicated parameters) do not."""


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank 0 of 1 without torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    """``gloo`` or ``nccl`` when a process group is active; None for a plain one-process run."""

    @property
    def active(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


def resolve_strategy(strategy: str) -> str:
    """``auto`` → ``ddp`` when torchrun started several processes, else ``none``; others as given."""
    if strategy != "auto":
        return strategy
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else _env_int("WORLD_SIZE", 1)
    return "ddp" if world > 1 else "none"


def setup(strategy: str, device: torch.device) -> tuple[DistEnv, torch.device]:
    """Join torchrun's process group (or reuse one) and return it with this rank's device. Raises ConfigError
    when ``--strategy`` and the launch disagree."""
    global _owns_process_group
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else _env_int("WORLD_SIZE", 1)
    if strategy == "none":
        if world > 1:
            raise ConfigError(
                f"{world} processes were started (WORLD_SIZE={world}) but --strategy is none, so each would "
                "train its own copy of the model; drop --strategy (several processes use ddp), or pass "
                "--strategy ddp (replicate the model, average gradients) or fsdp (shard params, gradients and "
                "optimizer state)"
            )
        return DistEnv(), device
    if not initialized:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise ConfigError(
                f"--strategy {strategy} needs processes started by torchrun ({', '.join(missing)} not set); run "
                f"`torchrun --nproc_per_node=N -m mixprec train ... --strategy {strategy}`, or drop --strategy"
            )
    if not dist.is_available():
        raise ConfigError(f"--strategy {strategy}: this PyTorch build has no torch.distributed")
    local_rank = _env_int("LOCAL_RANK", 0)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s): start at most "
                f"{torch.cuda.device_count()} processes per node (--nproc_per_node), or use --device cpu"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not initialized:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _owns_process_group = True
    env = DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                  backend=str(dist.get_backend()))
    return env, device


def teardown() -> None:
    """Destroy the process group if :func:`setup` created it (no-op otherwise)."""
    global _owns_process_group
    if _owns_process_group and dist.is_initialized():
        gc.collect()  # free FSDP modules (reference cycles) that hold the group before it goes
        dist.destroy_process_group()
    _owns_process_group = False


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_STOP_KEY = "mixprec/stop"


def stop_alone(reason: str) -> None:
    """Stop this rank outside any collective: leave the reason in the store for :func:`peer_stop` and ignore
    SIGTERM from here on. No-op on one process."""
    if not _active():
        return
    with contextlib.suppress(Exception):  # no store (a group without one): torchrun ends the peers
        dist.distributed_c10d._get_default_store().set(_STOP_KEY, f"rank {dist.get_rank()}: {reason}")
    _ignore_sigterm()


def peer_stop() -> str | None:
    """``rank 0 of 2 stopped with rank 1: <its reason>`` when another rank stopped alone (:func:`stop_alone`)
    and this rank's collective failed because of it; None otherwise. Ignores SIGTERM from then on, as
    :func:`stop_alone` does."""
    if not _active():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([_STOP_KEY]):
            return None
        reason = store.get(_STOP_KEY).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 -- the store went with the rank that hosted it
        return None
    _ignore_sigterm()
    return f"rank {dist.get_rank()} of {dist.get_world_size()} stopped with {reason}"


def _ignore_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ------------------------------------------------------------------------------------------ wrapping


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module: DDP's ``.module``; FSDP2 modifies the module in place, so it is itself."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def wrap_model(model: nn.Module, recipe, strategy: str, device: torch.device) -> nn.Module:
    """Wrap a converted model for ``strategy`` (call after ``recipe.convert_module``, before the optimizer)."""
    if strategy == "none" or not dist.is_initialized():
        return model
    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    policy = recipe.fsdp_policy()
    with torch.no_grad():  # FSDP2 shards only contiguous parameters (the cnn stores its convs channels-last)
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
    # Normalization layers are units of their own with fp32 params, as autocast keeps norms in fp32 (and
    # CPU batch_norm rejects bf16 weights next to its fp32 running statistics). Inner units first.
    fp32_policy = recipe.fsdp_policy(for_norm=True)
    for norm in [m for m in model.modules() if isinstance(m, _NORMS) and any(True for _ in m.parameters())]:
        fully_shard(norm, mp_policy=fp32_policy)
    for module_list in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        for block in module_list:
            fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Skip the gradient reduction of backwards run inside (every micro-batch but the last); no-op for a plain
    module or when ``enabled`` is False."""
    if not enabled:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif _is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


# --------------------------------------------------------------------------------------- reductions


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place and return it (returns ``t`` untouched on one process)."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    """Wait until every rank got here (no-op on one process)."""
    if _active():
        dist.barrier()


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over ranks (a new tensor, fp32 or wider; ``t`` itself on one process)."""
    if not _active():
        return t
    out = t.detach().clone()
    if out.dtype in (torch.float16, torch.bfloat16):
        out = out.float()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


def rows_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (same shape on all), stacked in rank order: shape ``(world_size, *t.shape)``; ``t``
    itself on one process."""
    if not _active():
        return t
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t.contiguous())
    return torch.stack(rows)


def max_over_ranks(x: float, device: torch.device) -> float:
    """Largest value of a Python float over ranks (for times: the slowest rank sets the pace)."""
    if not _active():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def eval_shard(n: int) -> tuple[torch.Tensor, int]:
    """This rank's strided evaluation indices, padded with index 0 to ``ceil(n / N)``, and how many are real."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _active() else (0, 1)
    idx = torch.arange(rank, n, world)
    per_rank = math.ceil(n / world)
    pad = torch.zeros(per_rank - len(idx), dtype=idx.dtype)
    return torch.cat([idx, pad]), len(idx)


# -------------------------------------------------------------------------------------- checkpoints


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state dicts to save from rank 0, keyed as in a one-process run. Under FSDP a
    collective every rank must call (rank 0 gets CPU tensors, the others empty dicts)."""
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        opts = _full_options()
        return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)
    return unwrap(model).state_dict(), optimizer.state_dict()


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Apply state dicts from :func:`state_dicts` (every rank passes the full dicts it read)."""
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=opts)
        if _has_tensor_state(optim_state):
            set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
        else:
            # Stateless optimizers (SGD without momentum) have nothing to distribute, and torch's full-state
            # loader asserts on an optimizer without tensor state ("Expected device to be set"): only the
            # hyperparameters of the param groups need restoring.
            for group, saved in zip(optimizer.param_groups, optim_state["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
        return
    unwrap(model).load_state_dict(model_state)
    optimizer.load_state_dict(optim_state)


def _has_tensor_state(optim_state: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and v.dim() > 0
               for st in optim_state.get("state", {}).values() for v in st.values())


# ---------------------------------------------------------------------------------------- consistency


def _checksum(params: Iterable[torch.Tensor]) -> tuple[float, float]:
    """Sum and sum of squares of all elements, in float64 (equal bits give equal sums)."""
    s = torch.zeros((), dtype=torch.float64)
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        v = local_tensor(p.detach()).double().cpu()
        s += v.sum()
        sq += v.square().sum()
    return float(s), float(sq)


def check_consistency(model: nn.Module, *, step: int, scale: float, skipped: int, device: torch.device) -> None:
    """All-gather loss scale, skipped-step count and a parameter checksum; raise RankDivergenceError if ranks
    differ. Syncs the host. Under FSDP only scale and skipped steps are compared. No-op on one process."""
    if not _active():
        return
    names = ["loss scale", "skipped steps"]
    values = [float(scale), float(skipped)]
    if not _is_fsdp(model):
        names += ["parameter sum", "parameter sum of squares"]
        values += list(_checksum(model.parameters()))
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    rows = torch.stack(gathered).cpu()
    bad = [j for j in range(len(names)) if not bool((rows[:, j] == rows[0, j]).all())]
    if bad:
        what = "; ".join(
            f"{names[j]}: " + ", ".join(f"rank {r} {rows[r, j].item():.17g}" for r in range(rows.shape[0]))
            for j in bad
        )
        raise RankDivergenceError(
            f"ranks diverged at step {step} (--check-consistency): {what}. Replicas must skip the same steps and "
            "hold the same parameters; check that every rank runs the same code and flags, and that the loss "
            "scaler all-reduces found_inf"
        )
