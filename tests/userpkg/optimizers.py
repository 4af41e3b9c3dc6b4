"""Users' optimizer factories, as `--optimizer tests.userpkg.optimizers:...` imports them (tests only)."""

import torch


def adamw(params, lr, weight_decay, betas=(0.9, 0.999)):
    """AdamW in its for-loop form: a different implementation from the built-in fused one."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, foreach=False)


def two_groups(params, lr):
    """Two parameter groups, the second at a tenth of the rate (a schedule must keep the ratio)."""
    params = list(params)
    return torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": lr / 10}], lr=lr, momentum=0.9)


def sgd_lr_only(params, lr):
    return torch.optim.SGD(params, lr=lr)


def raises(params, lr):
    raise ValueError("lr must be below 1e-2")


def returns_none(params):
    return None


def own_tensors(params, lr):
    """Ignores the params it is given: it would train nothing."""
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=lr)


def no_params():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
