"""``--optimizer module:callable``: the user's own optimizer, built over the tensors the recipe steps.

The factory gets the parameters :meth:`Recipe.build_optimizer <mixprec.precision.Recipe.build_optimizer>` passes
first, and by keyword whichever of ``lr``, ``weight_decay``, ``momentum`` and ``betas`` it declares::

    def lion(params, lr, weight_decay):
        return MyLion(params, lr=lr, weight_decay=weight_decay)

It must return a ``torch.optim.Optimizer`` over exactly those tensors. A flag it cannot receive is refused, not
ignored; every failure is a one-line :class:`~mixprec.train.usercode.UserCodeError`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable

import torch

from .config import OptimConfig
from .usercode import UserCodeError, call_declared, load_callable

__all__ = ["user_optimizer_factory"]

FLAG = "--optimizer"


def user_optimizer_factory(config: OptimConfig) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
    """``params -> optimizer`` from the factory ``config.optimizer`` names; imports it and checks that it can
    receive the flags given now, before anything is built."""
    ref = config.optimizer
    fn = load_callable(ref, FLAG)
    takes = _keywords(fn, ref)
    offered = {"lr": config.lr, "weight_decay": config.weight_decay, "momentum": config.momentum}
    if config.betas is not None:
        offered["betas"] = tuple(config.betas)
    refused = [(k, v) for k, v in offered.items() if k != "lr" and v and takes is not None and k not in takes]
    if refused:
        given = ", ".join(f"--{k.replace('_', '-')} {_show(v)}" for k, v in refused)
        raise UserCodeError(f"{FLAG} {ref!r} takes no {', '.join(k for k, _ in refused)} (its parameters: "
                            f"{', '.join(sorted(takes)) or 'none'} besides the params), so {given} would be "
                            "ignored; add the parameter to the factory or drop the flag")

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        opt = call_declared(functools.partial(fn, params), offered, ref=ref, flag=FLAG)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UserCodeError(f"{FLAG} {ref!r} returned {type(opt).__name__}, not a torch.optim.Optimizer; "
                                "return one built over the params it is given, e.g. torch.optim.AdamW(params, lr=lr)")
        stepped = {id(p) for g in opt.param_groups for p in g["params"]}
        if stepped != {id(p) for p in params}:
            missing = sum(id(p) not in stepped for p in params)
            raise UserCodeError(f"{FLAG} {ref!r} returned an optimizer that does not step the {len(params)} "
                                f"tensors it was given ({missing} missing, {len(stepped - {id(p) for p in params})} "
                                "others); build it over the params argument (the recipe may pass fp32 master "
                                "copies, not the model's parameters)")
        return opt

    return make


def _keywords(fn: Callable, ref: str) -> set[str] | None:
    """The keyword names the factory takes after its first (params) argument; None with ``**kwargs``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        raise UserCodeError(f"{FLAG} {ref!r} takes no positional argument; it must take the parameters first, "
                            "like def factory(params, lr): ...")
    return {p.name for p in params[1:] if p.kind is not inspect.Parameter.VAR_POSITIONAL}


def _show(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else f"{v:g}"
