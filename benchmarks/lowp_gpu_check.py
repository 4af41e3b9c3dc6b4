"""One linear layer's FP8/FP4 GEMMs on the GPU against the CPU emulation, per recipe and --fp8-impl.

Prints, for each recipe x implementation that builds on both devices, what the recipe says the device under test
does (real or emulated) and the relative difference of y, dx and dW between it and the CPU emulation. Real
kernels differ from the emulation by accumulation order and output rounding (expect ~1e-3 relative for bf16
outputs); a different quantisation shows as ~1e-2 (FP8) to ~1e-1 (FP4).

    PYTHONPATH=src python benchmarks/lowp_gpu_check.py                  # cpu (the reference) against cuda
    PYTHONPATH=src python benchmarks/lowp_gpu_check.py --devices cpu,cpu   # the script itself, on any machine:
                                                                          # every difference is 0
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from mixprec.errors import UsageError
from mixprec.precision import RecipeConfig, build_recipe

RECIPES = ("fp8-mixed", "fp8-rowwise", "mxfp8", "mxfp4", "nvfp4")
IMPLS = ("scratch", "torchao")


def run(precision: str, impl: str, device: str, x: torch.Tensor, dy: torch.Tensor):
    """(recipe, (y, dx, dW) on the CPU in fp32) of one layer's forward and backward on ``device``.

    The input is a fresh leaf on ``device`` (``x.to("cpu")`` of a CPU tensor is ``x`` itself: setting
    ``requires_grad`` on it would leak into the next run, whose copy would then be a non-leaf without ``.grad``).
    """
    r = build_recipe(RecipeConfig(precision=precision, amp_impl="native", fp8_impl=impl), device=device)
    torch.manual_seed(1)
    m = r.convert_module(nn.Sequential(nn.Linear(512, 512)))
    xi = x.detach().to(device).requires_grad_()
    with r.autocast():
        y = m(xi)
    y.backward(dy.to(device, y.dtype))
    return r, tuple(t.detach().float().cpu().clone() for t in (y, xi.grad, m[0].weight.grad))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="cpu,cuda", metavar="REF,TEST",
                   help="the reference device and the device under test (default cpu,cuda; cpu,cpu checks the "
                        "script on a machine without a GPU)")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--impls", default=",".join(IMPLS))
    args = p.parse_args(argv)
    devices = args.devices.split(",")
    if len(devices) != 2:
        p.error(f"--devices {args.devices!r}: give two devices, REF,TEST (e.g. cpu,cuda)")
    if "cuda" in devices and not torch.cuda.is_available():
        print("lowp_gpu_check.py: no CUDA device here; --devices cpu,cpu runs the check on the CPU", file=sys.stderr)
        raise SystemExit(2)
    torch.manual_seed(0)
    x, dy = torch.randn(256, 512), torch.randn(256, 512) * 1e-3
    for precision in args.recipes.split(","):
        for impl in args.impls.split(","):
            try:
                _, ref = run(precision, impl, devices[0], x, dy)
                r, got = run(precision, impl, devices[1], x, dy)
            except UsageError as e:
                print(f"{precision} [{impl}]: not run: {e}")
                continue
            rel = " ".join(f"{float((a - b).norm() / b.norm()):.2e}" for a, b in zip(got, ref))
            print(f"{precision} [{impl}] on {devices[1]}, real={r.fp8.real()}: y/dx/dW relative to {devices[0]} "
                  f"{rel}", flush=True)


if __name__ == "__main__":
    main()
