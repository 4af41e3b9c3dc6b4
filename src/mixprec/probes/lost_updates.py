"""Lost updates: parameter updates that were non-zero but rounded away, ``low(w + Δ) == w``.

:class:`LostUpdateMonitor` hooks ``optimizer.step`` (or is driven through :meth:`~LostUpdateMonitor.before_step` /
:meth:`~LostUpdateMonitor.after_step`), so it sees the tensors the optimizer steps (low-precision weights, fp32
masters). Before the step it runs a *shadow* step -- the same optimizer class and hyper-parameters over fp32
copies of the tensors, gradients and state -- whose result minus ``w`` is the intended update ``Δ``; ``w + Δ`` is
computed exactly (float64) and rounded to the stored dtype. The post hook also counts the elements the real step
left unchanged, as a cross-check. Counts stay on the device until one host read per step.

The median update-to-weight ratio ``|Δ| / |w|`` (above 1: the learning rate is far too large) is judged only on
tensors whose RMS at the first step is at least :data:`RATIO_FLOOR`: a zero-initialised tensor is the sum of its
own updates, so its ratio measures the step count, not the learning rate.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..memory import local_tensor
from .observer import dtype_name
from .subsample import flat_sample, stride_for

__all__ = ["LayerUpdates", "LostUpdates", "LostUpdateMonitor", "RATIO_FLOOR", "optimizer_param_names",
           "same_optimizer"]

RATIO_FLOOR = 1e-3
"""RMS a tensor needs at the first step for its update-to-weight ratio to be judged (module docstring)."""


@functools.lru_cache(maxsize=32)
def _init_parameters(opt_cls: type) -> Any:
    return inspect.signature(opt_cls.__init__).parameters


def same_optimizer(opt_cls: type, params: Any, hyper: dict[str, Any]) -> torch.optim.Optimizer:
    """``opt_cls(params, **hyper)`` with only the hyper-parameters its constructor accepts.

    ``optimizer.defaults`` can hold keys the constructor does not take (AdamW's ``decoupled_weight_decay``).
    """
    accepted = _init_parameters(opt_cls)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        hyper = {k: v for k, v in hyper.items() if k in accepted}
    return opt_cls(params, **{k: v for k, v in hyper.items() if k != "fused"})


@dataclasses.dataclass
class LayerUpdates:
    name: str
    dtype: str
    """Dtype of the tensors the optimizer steps (``fp32`` for master copies)."""
    updated: int = 0
    """Elements with a non-zero intended update, summed over steps."""
    lost: int = 0
    """Of those, elements where ``low(w + Δ) == w``."""
    unchanged: int = 0
    """Of those, elements the real step left unchanged (cross-check of ``lost``)."""
    ratios: list[float] = dataclasses.field(default_factory=list)
    """Per step and judged tensor, the median of ``|Δ| / |w|`` over non-zero ``w``."""
    unjudged: list[str] = dataclasses.field(default_factory=list)
    """Tensors left out of ``ratios``: RMS below :data:`RATIO_FLOOR` at the first step (zero/near-zero init)."""
    examined: int = 0
    """Elements the counts above were taken over, summed over steps (all of them, or a subsample's)."""
    elements: int = 0
    """Elements of the stepped tensors, summed over steps."""

    @property
    def lost_fraction(self) -> float:
        return self.lost / self.updated if self.updated else 0.0

    @property
    def median_ratio(self) -> float | None:
        return sorted(self.ratios)[len(self.ratios) // 2] if self.ratios else None

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.name, "dtype": self.dtype, "updated": self.updated, "lost": self.lost,
                "unchanged": self.unchanged, "lost_fraction": self.lost_fraction,
                "median_update_ratio": self.median_ratio, "ratio_not_judged": list(self.unjudged),
                "elements_examined": self.examined, "elements": self.elements}


@dataclasses.dataclass
class LostUpdates:
    layers: list[LayerUpdates]
    steps: int

    @property
    def lost_fraction(self) -> float:
        upd = sum(layer.updated for layer in self.layers)
        return sum(layer.lost for layer in self.layers) / upd if upd else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "lost_fraction": self.lost_fraction,
                "layers": [layer.to_dict() for layer in self.layers]}


def optimizer_param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[int, str]:
    """Name each tensor the optimizer steps after the model parameter it stands for.

    The optimizer holds either the model's parameters or master copies of them, in the model's
    parameter order (mixprec's MasterWeights keeps that order); matching falls back to position.
    """
    by_id = {id(p): n for n, p in model.named_parameters()}
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    names: dict[int, str] = {}
    model_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for i, p in enumerate(stepped):
        if id(p) in by_id:
            names[id(p)] = by_id[id(p)]
        elif len(stepped) == len(model_params) and model_params[i][1].shape == p.shape:
            names[id(p)] = model_params[i][0]
        else:
            names[id(p)] = f"param{i}"
    return names


def _layer_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Rprop, torch.optim.ASGD)
"""Optimizers whose update of an element depends only on that element (its weight, gradient and state) and on
scalars: stepping a subsample of a tensor gives exactly the subsample of the whole step."""


class LostUpdateMonitor:
    """Measures lost updates on every ``optimizer.step()`` while active (``with monitor:``).

    ``max_elements``: measure a tensor of more elements on its strided subsample (:mod:`.subsample`), for the
    optimizers in ``_ELEMENTWISE`` only (the shadow step of a subsample is then exactly the subsample of the
    shadow step); None measures every element. ``LayerUpdates.examined`` says how many were.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str], *,
                 max_elements: int | None = None) -> None:
        self.optimizer = optimizer
        self.names = names
        self.max_elements = max_elements if max_elements and type(optimizer) in _ELEMENTWISE else None
        self._layers: dict[str, LayerUpdates] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, LayerUpdates, bool]] = []
        self._judged: dict[int, bool] = {}
        self._handles: list[Any] = []
        self.steps = 0

    def __enter__(self) -> LostUpdateMonitor:
        self._handles = [self.optimizer.register_step_pre_hook(self._pre),
                         self.optimizer.register_step_post_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _shadow_updates(self, opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor, int]]:
        """(param, its positions read, Δ, elements) for each param with a gradient: the update an all-fp32
        optimizer would make, on the whole param or (``max_elements``) on its subsample."""
        if self.max_elements is not None:
            return self._shadow_subsample(opt)
        groups, pairs = [], []
        for g in opt.param_groups:
            shadow = []
            for p in g["params"]:
                lp = local_tensor(p)  # a sharded (FSDP2) parameter: this rank's shard, counted per element
                s = lp.detach().float().clone()
                if p.grad is not None:
                    s.grad = local_tensor(p.grad).detach().float().clone()
                shadow.append(s)
                pairs.append((p, lp, s))
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": shadow})
        sopt = same_optimizer(type(opt), groups, dict(opt.defaults))
        state = opt.state_dict()
        state["state"] = {i: {k: local_tensor(v) for k, v in st.items()} for i, st in state["state"].items()}
        sopt.load_state_dict(copy.deepcopy(state))  # load_state_dict casts state to fp32
        with torch.no_grad():
            before = [s.clone() for _, _, s in pairs]
            sopt.step()
        return [(p, lp.detach(), s - b, lp.numel()) for (p, lp, s), b in zip(pairs, before) if p.grad is not None]

    def _shadow_subsample(self, opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, int]]:
        """The shadow step over fp32 copies of each tensor's subsample, its gradient's and its state's (the
        same positions); scalar state (``step``) is copied."""
        groups, rows = [], []
        for g in opt.param_groups:
            shadow = []
            for p in g["params"]:
                if p.grad is None:
                    continue
                lp = local_tensor(p)
                stride = stride_for(lp, self.max_elements)
                view = flat_sample(lp.detach(), stride)
                s = view.to(torch.float32, copy=True)
                s.grad = flat_sample(local_tensor(p.grad).detach(), stride, like=lp).to(torch.float32, copy=True)
                shadow.append(s)
                rows.append((p, lp, view, s, stride))
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": shadow})
        sopt = same_optimizer(type(opt), groups, dict(opt.defaults))
        for p, lp, _, s, stride in rows:
            state = opt.state.get(p)
            if state:
                local = {k: local_tensor(v) for k, v in state.items()}
                sopt.state[s] = {k: (flat_sample(v.detach(), stride, like=lp).to(torch.float32, copy=True)
                                     if isinstance(v, torch.Tensor) and v.shape == lp.shape and v.is_floating_point()
                                     else v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                                 for k, v in local.items()}
        with torch.no_grad():
            before = [s.clone() for _, _, _, s, _ in rows]
            sopt.step()
        return [(p, view, s - b, lp.numel()) for (p, lp, view, s, _), b in zip(rows, before)]

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.before_step(opt)

    def before_step(self, opt: torch.optim.Optimizer) -> None:
        """The gradients are final and not applied: run the shadow step (what ``with monitor:`` hooks in;
        a caller that drives the monitor itself calls this and :meth:`after_step` around one step)."""
        self._pending.clear()
        with _disable_current_modes():  # the shadow step is not part of the observed step
            updates = self._shadow_updates(opt)
        for p, now, delta, elements in updates:
            name = self.names.get(id(p), "?")
            layer = _layer_of(name)
            lu = self._layers.get(layer)
            if lu is None:
                lu = self._layers[layer] = LayerUpdates(layer, dtype_name(p.dtype))
            with _disable_current_modes():
                judged = self._judge(p, name, lu)
                self._pending.append((now, now.clone(), delta, lu, judged))
            lu.examined += delta.numel()
            lu.elements += elements

    def _judge(self, p: torch.Tensor, name: str, lu: LayerUpdates) -> bool:
        """Whether ``p``'s update-to-weight ratio means anything: decided once, at the first step it is seen (on
        a sharded parameter, by this rank's shard)."""
        if id(p) not in self._judged:
            lp = local_tensor(p)
            rms = float(lp.detach().double().norm()) / max(1, lp.numel()) ** 0.5
            self._judged[id(p)] = rms >= RATIO_FLOOR
            if rms < RATIO_FLOOR:
                lu.unjudged.append(name)
        return self._judged[id(p)]

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.after_step(opt)

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        """The update was applied: count the lost updates of the step :meth:`before_step` saw."""
        with torch.no_grad(), _disable_current_modes():
            self._count()

    def _count(self) -> None:
        values = self._counts().tolist() if self._pending else []  # the one host read
        for (*_, lu, judged), (updated, lost_n, unchanged_n, ratio) in zip(self._pending, values):
            lu.updated += int(updated)
            lu.lost += int(lost_n)
            lu.unchanged += int(unchanged_n)
            if judged and not math.isnan(ratio):
                lu.ratios.append(ratio)
        self._pending.clear()
        self.steps += 1

    def _counts(self) -> torch.Tensor:
        """Per pending tensor ``(updated, lost, unchanged, median ratio)`` as float64 rows, made on its tensor's
        device and gathered on the first accelerator among them; no host read, no boolean indexing (nanmedian
        over the moved, non-zero weights is the same lower median)."""
        rows = []
        for p, before, delta, _, judged in self._pending:
            moved = delta != 0
            if p.dtype == delta.dtype == torch.float32:  # IEEE addition rounds the exact sum once: no float64 needed
                rounded = before + delta
            else:
                rounded = (before.double() + delta.double()).to(p.dtype)
            lost = moved & (rounded == before)
            unchanged = moved & (p.detach() == before)
            if judged:
                nz = moved & (before != 0)
                ratio = torch.where(nz, delta.abs() / before.float().abs(), math.nan).flatten().nanmedian()
            else:
                ratio = delta.new_full((), math.nan)
            rows.append(torch.stack([moved.sum().double(), lost.sum().double(), unchanged.sum().double(),
                                     ratio.double()]))
        device = next((r.device for r in rows if r.device.type != "cpu"), rows[0].device)
        return torch.stack([r.to(device) for r in rows])

    def result(self, order: Iterable[str] | None = None) -> LostUpdates:
        layers = list(self._layers.values())
        if order is not None:
            rank = {n: i for i, n in enumerate(order)}
            layers.sort(key=lambda lu: rank.get(lu.name, len(rank)))
        return LostUpdates(layers=layers, steps=self.steps)
