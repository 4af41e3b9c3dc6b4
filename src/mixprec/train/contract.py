"""How mixprec calls your model: the one contract train, bench, doctor and the Python APIs share.

**Batches.** ``(inputs, targets)`` → ``model(inputs)``; ``(input_1, ..., input_n, targets)`` →
``model(input_1, ..., input_n)``; a dict → ``model(**batch)``, targets under ``labels`` (or ``label``,
``targets``, ``target``), kept in the call only when ``forward`` takes them; keys ``forward`` does not accept
are left out, and the run says which. A tuple batch's targets go to a ``forward`` parameter named ``targets``
or ``labels``.

**Outputs.** A tensor (the logits); a tuple or list (a 0-dim tensor is the loss, the first tensor with
dimensions the logits); a dict, a Hugging Face ``ModelOutput`` or any object with ``logits`` / ``loss``.

**Loss.** An explicit ``--loss`` (on the raw output), else the model's own loss, else the task's
(:mod:`mixprec.train.tasks`). Anything else is a :class:`ContractError` (exit 2), one line.

**Dtypes.** :func:`normalize_inputs` / :func:`normalize_targets`: float64 becomes float32, integer targets int64.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import UsageError

__all__ = ["ContractError", "Batch", "Output", "ModelCall", "Objective", "as_batch", "parse_output",
           "compute_loss", "normalize_inputs", "normalize_targets", "normalize_batch", "TARGET_KEYS",
           "describe_output", "describe_batch"]

TARGET_KEYS = ("labels", "label", "targets", "target")
"""Keys of a dict batch that hold the targets, in the order they are looked for."""

_TARGET_PARAMS = ("targets", "labels")
"""Names of a ``forward`` parameter that receives a tuple batch's targets."""


class ContractError(UsageError):
    """A batch or a model output mixprec cannot use; the message says what it got and what it expects."""


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """One batch in the contract's terms."""

    args: tuple[Any, ...]
    """Positional inputs of the call."""
    kwargs: dict[str, Any]
    """Keyword inputs of the call (dict batches; ``labels`` included when ``forward`` takes it)."""
    targets: torch.Tensor | None
    """What metrics and the default loss compare with; None when the batch has none."""

    def __len__(self) -> int:
        """Samples in the batch: the first dimension of the targets, else of the first tensor input."""
        for t in (self.targets, *self.args, *self.kwargs.values()):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                return int(t.shape[0])
        return 1

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Batch:
        def move(t: Any) -> Any:
            return t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t

        return Batch(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()},
                     move(self.targets))

    def inputs(self) -> list[torch.Tensor]:
        """Every tensor the model is called with (for probes and memory accounting)."""
        return [t for t in (*self.args, *self.kwargs.values()) if isinstance(t, torch.Tensor)]

    def head(self, k: int) -> Batch:
        """The first ``k`` samples: every tensor whose first dimension is the batch's is sliced."""
        n = len(self)

        def cut(t: Any) -> Any:
            return t[:k] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n else t

        return Batch(tuple(cut(a) for a in self.args), {key: cut(v) for key, v in self.kwargs.items()},
                     cut(self.targets))

    def nonfinite(self) -> list[str]:
        """The batch's tensors that hold inf or nan, each named with its counts (``input 0: 3 nan, 0 inf of 4096
        values``; ``'pixel_values'``; ``the targets``); empty when the batch is finite. Reads every floating
        tensor on the host: call it where a run stops or a capture is taken, never per step."""
        named = [(f"input {i}", a) for i, a in enumerate(self.args)]
        named += [(repr(k), v) for k, v in self.kwargs.items()]
        if not any(self.targets is t for _, t in named):
            named.append(("the targets", self.targets))
        bad = []
        for name, t in named:
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
                t = t.detach()
                n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
                if n_nan or n_inf:
                    bad.append(f"{name}: {n_nan} nan, {n_inf} inf of {t.numel()} values")
        return bad

    def describe(self) -> str:
        """``inputs (4, 3) float32, targets (4,) int64`` / ``dict {'input_ids': (4, 8) int64, ...}``."""
        if self.kwargs:
            return "a dict {" + ", ".join(f"{k!r}: {_tensor_text(v)}" for k, v in self.kwargs.items()) + "}"
        inputs = ", ".join(_tensor_text(a) for a in self.args)
        return f"inputs {inputs}, targets {_tensor_text(self.targets)}"


def _tensor_text(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
    return type(t).__name__


def describe_batch(raw: Any) -> str:
    """What a loader's batch holds, for messages (anything that is not a batch is named by its type)."""
    try:
        return as_batch(raw).describe()
    except ContractError:
        return _kind(raw)


def as_batch(raw: Any) -> Batch:
    """A loader's batch (see the module docstring) as a :class:`Batch`; anything else is a ContractError."""
    if isinstance(raw, Batch):
        return raw
    if isinstance(raw, Mapping):
        kwargs = dict(raw)
        targets = next((kwargs[k] for k in TARGET_KEYS if k in kwargs), None)
        return Batch((), kwargs, targets)
    if isinstance(raw, (tuple, list)) and len(raw) >= 2:
        return Batch(tuple(raw[:-1]), {}, raw[-1])
    raise ContractError(
        f"a batch is {_kind(raw)}; mixprec expects (inputs, targets), (input_1, ..., input_n, targets) or a dict "
        "of tensors (model(**batch), targets under 'labels')")


@dataclasses.dataclass(frozen=True, eq=False)
class Output:
    """A model's output in the contract's terms."""

    raw: Any
    """What the model returned (what an explicit ``--loss`` receives)."""
    logits: torch.Tensor | None
    """The predictions metrics use (the tensor itself, ``.logits``, or a tuple's first tensor with dimensions)."""
    loss: torch.Tensor | None
    """The loss the model computed itself, if it returned one."""


def parse_output(out: Any) -> Output:
    """Find the logits and the model's own loss in whatever the model returned (see the module docstring)."""
    if isinstance(out, torch.Tensor):
        return Output(out, out, None)
    if isinstance(out, Mapping):
        return Output(out, _tensor_or_none(out.get("logits")), _scalar_or_none(out.get("loss")))
    if isinstance(out, (tuple, list)):
        loss = next((t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0), None)
        logits = next((t for t in out if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if loss is None and logits is None:
            raise ContractError(f"the model returned {describe_output(out)} with no tensor in it; "
                                f"{_EXPECTED}")
        return Output(out, logits, loss)
    if hasattr(out, "logits") or hasattr(out, "loss"):
        return Output(out, _tensor_or_none(getattr(out, "logits", None)),
                      _scalar_or_none(getattr(out, "loss", None)))
    raise ContractError(f"the model returned {describe_output(out)}; {_EXPECTED}")


_EXPECTED = ("mixprec expects a tensor of logits, a tuple such as (logits, loss), or a dict / ModelOutput with "
             "'logits' (and 'loss' when the model computes it)")


def describe_output(out: Any) -> str:
    """``a tensor of shape (2, 10)``, ``a tuple (tensor (2, 10), None)``, ``a dict with keys ['a', 'b']`` ..."""
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, Mapping):
        return f"{_article(type(out).__name__)} with keys {list(out.keys())}"
    if isinstance(out, (tuple, list)):
        items = ", ".join(f"tensor {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                          for t in list(out)[:4])
        return f"a {type(out).__name__} ({items}{', ...' if len(out) > 4 else ''})"
    return _article(type(out).__name__)


def _article(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _kind(raw: Any) -> str:
    if isinstance(raw, torch.Tensor):
        return f"a single tensor of shape {tuple(raw.shape)} (no targets)"
    if isinstance(raw, (tuple, list)):
        return f"a {type(raw).__name__} of {len(raw)} item(s)"
    return _article(type(raw).__name__)


def _tensor_or_none(x: Any) -> torch.Tensor | None:
    return x if isinstance(x, torch.Tensor) else None


def _scalar_or_none(x: Any) -> torch.Tensor | None:
    return x if isinstance(x, torch.Tensor) and x.numel() == 1 else None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
    return model


class ModelCall:
    """How to call one model with a :class:`Batch`, worked out once from its ``forward`` signature (wrappers are
    looked through for the signature; the call goes to ``model`` itself, so DDP and FSDP hooks run)."""

    def __init__(self, model: nn.Module) -> None:
        self.name = type(unwrap(model)).__name__
        try:
            params = list(inspect.signature(unwrap(model).forward).parameters.values())
        except (TypeError, ValueError):  # builtins without a signature: call with what the batch has
            params = []
        self.var_keyword = not params or any(p.kind is p.VAR_KEYWORD for p in params)
        self.var_positional = not params or any(p.kind is p.VAR_POSITIONAL for p in params)
        self.names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.required = [p.name for p in params if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.target_param = next((n for n in _TARGET_PARAMS if n in self.names), None)
        self.pass_targets = True
        """Whether targets go into the call (``labels`` of a dict batch, ``targets=`` / ``labels=`` of a tuple
        batch). The probe turns it off for a language model that shifts its labels inside when the data's
        targets are already the next tokens (they would be shifted twice)."""
        self.dropped: tuple[str, ...] = ()
        """Keys of the last dict batch left out of the call because ``forward`` does not take them."""

    def takes(self, name: str) -> bool:
        return self.var_keyword or name in self.names

    def arguments(self, batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments ``model`` is called with for ``batch``."""
        if batch.kwargs:
            kwargs = {k: v for k, v in batch.kwargs.items()
                      if self.takes(k) and (self.pass_targets or k not in TARGET_KEYS)}
            self.dropped = tuple(k for k in batch.kwargs if k not in kwargs and k not in TARGET_KEYS)
            missing = [n for n in self.required if n not in kwargs]
            if missing:
                raise ContractError(
                    f"{self.name}.forward needs {', '.join(repr(m) for m in missing)}, but the batch dict has "
                    f"keys {list(batch.kwargs)}; make the data yield {', '.join(repr(m) for m in missing)}")
            return (), kwargs
        kwargs = {}
        if self.pass_targets and self.target_param is not None and batch.targets is not None \
                and len(batch.args) < self.names.index(self.target_param) + 1:
            kwargs[self.target_param] = batch.targets
        return batch.args, kwargs

    def __call__(self, model: nn.Module, batch: Batch) -> Output:
        args, kwargs = self.arguments(batch)
        return parse_output(model(*args, **kwargs))


@dataclasses.dataclass(eq=False)
class Objective:
    """How a step gets its loss from a model and a batch: the call, the task, and an explicit ``--loss``.
    Every loss in train, bench and doctor comes from here."""

    call: ModelCall
    """How the model is called (worked out from its ``forward`` once)."""
    task: Any
    """The :class:`mixprec.train.tasks.Task`: default loss and metrics."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """The explicit ``--loss`` (given the raw output and the targets), or None."""

    def forward(self, model: nn.Module, batch: Batch) -> Output:
        return self.call(model, batch)

    def loss(self, output: Output, batch: Batch) -> torch.Tensor:
        return compute_loss(output, batch, loss_fn=self.loss_fn, default=self.task.default_loss)

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The loss of ``model`` on ``batch``."""
        return self.loss(self.forward(model, batch), batch)


def compute_loss(output: Output, batch: Batch, *, loss_fn: Callable[..., torch.Tensor] | None,
                 default: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """The step's loss by the contract's rule: ``loss_fn`` (explicit ``--loss``, given the raw output), else
    the model's own, else ``default(logits, targets)`` (the task's)."""
    if loss_fn is not None:
        return loss_fn(output.raw, batch.targets)
    if output.loss is not None:
        return output.loss
    if batch.targets is None:
        raise ContractError("the model returned no loss and the batch has no targets; return a loss from "
                            "forward, put the targets under 'labels', or pass --loss module:callable")
    if output.logits is None:
        raise ContractError(f"the model returned {describe_output(output.raw)} with neither 'logits' nor 'loss'; "
                            f"{_EXPECTED}")
    return default(output.logits, batch.targets)


def normalize_inputs(x: Any) -> Any:
    """float64 tensors become float32; everything else is returned as it is (dicts and tuples walked)."""
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype == torch.float64 else x
    if isinstance(x, Mapping):
        return {k: normalize_inputs(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(normalize_inputs(v) for v in x)
    return x


def normalize_targets(y: Any) -> Any:
    """Integer targets of any width (and bool) become int64, float64 ones float32, other floats stay."""
    if not isinstance(y, torch.Tensor):
        return y
    if y.dtype == torch.bool or not (y.is_floating_point() or y.is_complex()):
        return y if y.dtype == torch.int64 else y.long()
    return y.float() if y.dtype == torch.float64 else y


def normalize_batch(raw: Any) -> Any:
    """A loader's batch with :func:`normalize_inputs` applied to its inputs and :func:`normalize_targets` to
    its targets (a tuple's last item, a dict's target keys); its container kept."""
    if isinstance(raw, Mapping):
        return {k: normalize_targets(v) if k in TARGET_KEYS else normalize_inputs(v) for k, v in raw.items()}
    if isinstance(raw, (tuple, list)) and len(raw) >= 2:
        return type(raw)([*(normalize_inputs(v) for v in raw[:-1]), normalize_targets(raw[-1])])
    return raw


def is_float64(x: Any) -> bool:
    """Whether any tensor in ``x`` (walked as :func:`normalize_inputs` does) is float64."""
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.float64
    if isinstance(x, Mapping):
        return any(is_float64(v) for v in x.values())
    if hasattr(x, "dtype") and hasattr(x, "shape"):  # a numpy array, which the DataLoader makes a tensor
        return str(x.dtype) == "float64"
    if isinstance(x, (tuple, list)):
        return any(is_float64(v) for v in x)
    return False
