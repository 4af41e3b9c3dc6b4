"""FP32 master weights for fp16/bf16 parameters.

bf16 has 8 significant bits: just below 1.0 one ulp is 2**-8, and an update with ``|Δ| < ulp(w) / 2`` is
rounded away (``bf16(w + Δ) == w``; "lost updates"). The optimizer therefore updates an fp32 copy (where
small steps accumulate) and the model gets ``round(master)`` after every step, tracking the fp32 trajectory
to within half an ulp. Build the optimizer over :attr:`MasterWeights.master_params` (its state is fp32 too)::

    mw = MasterWeights(model)                       # model params are bf16 or fp16
    opt = torch.optim.AdamW(mw.master_params, lr=1e-3)
    loss.backward()                                 # low-precision grads on the model
    mw.copy_grads_to_master()                       # -> fp32 grads on the masters; model grads freed
    scaler.step(opt); scaler.update()               # (fp16: unscale + inf check happen in fp32)
    mw.write_back()                                 # model params = round(master)

``rounding="stochastic"`` makes ``E[write_back] = master`` (:mod:`mixprec.formats`). ``resync=True`` re-reads
the masters from the model before every step, so no fp32 state persists ("bf16-true"; only stochastic rounding
then keeps small updates alive). fp32 (or wider) parameters are shared, not copied, and write-back skips them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.formats import get_format, quantize

__all__ = ["MasterWeights"]

_WIDE = (torch.float32, torch.float64)


class MasterWeights:
    """FP32 master copies of a module's (or a list's) low-precision parameters.

    ``generator`` (on the parameters' device; ``None``: the global one) drives stochastic rounding and is
    saved in :meth:`state_dict` when given.
    """

    def __init__(
        self,
        params_or_module: nn.Module | Iterable[torch.Tensor],
        *,
        rounding: str = "nearest",
        generator: torch.Generator | None = None,
        resync: bool = False,
    ) -> None:
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"MasterWeights(..., rounding={rounding!r}): use 'nearest' or 'stochastic'")
        if isinstance(params_or_module, nn.Module):
            params = list(params_or_module.parameters())
        elif isinstance(params_or_module, torch.Tensor):
            raise TypeError("MasterWeights(tensor): pass a module or a list of parameters, e.g. [weight]")
        else:
            params = list(params_or_module)
        seen: set[int] = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise TypeError(f"MasterWeights(...): parameter {i} is not a floating-point tensor ({type(p).__name__})")
            if id(p) in seen:
                raise ValueError(f"MasterWeights(...): parameter {i} appears twice; pass each parameter once")
            seen.add(id(p))
            if rounding == "stochastic" and p.dtype not in _WIDE:
                get_format(p.dtype)  # raises a clear ValueError for dtypes quantize cannot round to
        self.rounding = rounding
        self.generator = generator
        self.resync = bool(resync)
        self.model_params: list[torch.Tensor] = params
        self.master_params: list[torch.Tensor] = [p if p.dtype in _WIDE else _fp32_copy(p) for p in params]

    def _pairs(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        return ((p, m) for p, m in zip(self.model_params, self.master_params) if m is not p)

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """Overwrite each fp32 master with its model parameter (an exact upcast)."""
        for p, m in self._pairs():
            m.copy_(p)

    @torch.no_grad()
    def copy_grads_to_master(self) -> None:
        """Move each model ``.grad`` to its master in fp32 (still loss-scaled if the loss was); the model's
        ``.grad`` becomes None (as does a master's whose param has none). ``resync=True``: sync first."""
        if self.resync:
            self.sync_from_model()
        for p, m in self._pairs():
            g = p.grad
            if g is None:
                m.grad = None
                continue
            if m.grad is None or m.grad.shape != g.shape:
                m.grad = g.to(torch.float32, copy=True)
            else:
                m.grad.copy_(g)
            p.grad = None

    @torch.no_grad()
    def write_back(self, unless: torch.Tensor | None = None) -> None:
        """Round each fp32 master to its model parameter's dtype and store it there, in place.

        ``unless`` (0-dim, on the device): where it is non-zero the params keep their values (a step skipped on the
        device; without a host read). Only stochastic rounding needs it: rounding to nearest an unchanged master
        gives the param it already holds."""
        for p, m in self._pairs():
            if self.rounding == "nearest":
                p.copy_(m)
            elif unless is None:
                p.copy_(quantize(m, p.dtype, "stochastic", generator=self.generator))
            else:
                q = quantize(m, p.dtype, "stochastic", generator=self.generator)
                torch.where(unless.to(p.device) > 0, p, q.to(p.dtype), out=p)

    def nbytes(self) -> int:
        """Bytes of the fp32 master copies (shared fp32 params and gradients not counted)."""
        return sum(m.numel() * m.element_size() for _, m in self._pairs())

    def state_dict(self) -> dict[str, Any]:
        """``master_params`` (aligned with the params; None where shared; references, as in
        ``nn.Module.state_dict``), ``rounding``, ``resync``, ``generator_state`` (None without a generator)."""
        return {
            "master_params": [None if m is p else m.detach() for p, m in zip(self.model_params, self.master_params)],
            "rounding": self.rounding,
            "resync": self.resync,
            "generator_state": None if self.generator is None else self.generator.get_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy saved masters in place (the optimizer keeps its references) and the generator state when
        both sides have one. The model params are not touched."""
        if not isinstance(state_dict, Mapping) or "master_params" not in state_dict:
            raise ValueError(
                "MasterWeights.load_state_dict(...): expected the dict returned by MasterWeights.state_dict() "
                "(with a 'master_params' key)"
            )
        saved = list(state_dict["master_params"])
        if len(saved) != len(self.master_params):
            raise ValueError(
                f"MasterWeights.load_state_dict(...): the state has {len(saved)} master params, this model has "
                f"{len(self.master_params)}; build MasterWeights over the same parameters in the same order"
            )
        for i, (p, m, s) in enumerate(zip(self.model_params, self.master_params, saved)):
            if (s is None) != (m is p) or (s is not None and s.shape != m.shape):
                raise ValueError(
                    f"MasterWeights.load_state_dict(...): master param {i} does not match "
                    f"(saved {None if s is None else tuple(s.shape)}, expected "
                    f"{None if m is p else tuple(m.shape)}); build MasterWeights over the same parameters"
                )
        with torch.no_grad():
            for m, s in zip(self.master_params, saved):
                if s is not None:
                    m.copy_(s)
        gen_state = state_dict.get("generator_state")
        if self.generator is not None and gen_state is not None:
            self.generator.set_state(gen_state)


def _fp32_copy(p: torch.Tensor) -> torch.Tensor:
    return p.detach().to(torch.float32, copy=True).requires_grad_(p.requires_grad)
