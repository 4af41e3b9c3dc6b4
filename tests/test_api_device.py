"""The Python API's default device is ``--device auto``'s (cuda where available), as the CLI's is; an explicit
``device="cpu"`` still builds on the CPU. CUDA is pretended (``torch.cuda.is_available``, what
:func:`mixprec.hardware.resolve_device` reads); nothing is built on it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import doctor
from mixprec.precision import build_recipe
from mixprec.train import distributed


@pytest.fixture
def pretend_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("device", [{}, {"device": None}, {"device": "auto"}], ids=["default", "None", "auto"])
def test_build_recipe_defaults_to_cuda_where_available(pretend_cuda, device):
    # a recipe asks the device's capabilities once when built, which a pretended GPU cannot answer: planned
    # (for_target) for the device auto picks, the device is resolved as for a run and not queried
    assert build_recipe("fp32", for_target=True, **device).device == torch.device("cuda")
    assert build_recipe("bf16-mixed", for_target=True, **device).device == torch.device("cuda")


def test_build_recipe_on_an_explicit_cpu_stays_there(pretend_cuda):
    assert build_recipe("bf16-mixed", device="cpu").device == torch.device("cpu")
    assert build_recipe("fp32", device=torch.device("cpu")).device == torch.device("cpu")


class _Resolved(Exception):
    """Raised where the run joins its device: what the doctor API resolved, before anything is built."""


@pytest.fixture
def resolved_device(monkeypatch):
    def setup(strategy, device):
        raise _Resolved(device)

    monkeypatch.setattr(distributed, "setup", setup)

    def resolve(call, **kw) -> torch.device:
        model, batch = nn.Linear(4, 2), (torch.randn(3, 4), torch.randint(0, 2, (3,)))
        with pytest.raises(_Resolved) as e:
            call(model, batch, nn.functional.cross_entropy, **kw)
        return e.value.args[0]

    return resolve


_DOCTOR_API = [doctor.diagnose, doctor.precision_map, doctor.find_first_nonfinite]


@pytest.mark.parametrize("call", _DOCTOR_API, ids=lambda f: f.__name__)
def test_the_doctor_api_defaults_to_cuda_where_available(pretend_cuda, resolved_device, call):
    assert resolved_device(call) == torch.device("cuda")
    assert resolved_device(call, device=None) == torch.device("cuda")


@pytest.mark.parametrize("call", _DOCTOR_API, ids=lambda f: f.__name__)
def test_the_doctor_api_on_an_explicit_cpu_stays_there(pretend_cuda, resolved_device, call):
    assert resolved_device(call, device="cpu") == torch.device("cpu")
