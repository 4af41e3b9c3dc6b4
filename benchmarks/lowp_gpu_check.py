"""One linear layer's FP8/FP4 GEMMs on the GPU against the CPU emulation, per recipe and --fp8-impl.

Prints, for each recipe x implementation that builds on both devices, what the recipe says the GPU does (real
or emulated) and the relative difference of y, dx and dW between the GPU and the exact CPU emulation. Real
kernels differ from the emulation by accumulation order and output rounding (expect ~1e-3 relative for bf16
outputs); a different quantisation shows as ~1e-2 (FP8) to ~1e-1 (FP4). UNTESTED: written without a GPU.

    python benchmarks/lowp_gpu_check.py
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.errors import UsageError
from mixprec.precision import RecipeConfig, build_recipe


def run(precision: str, impl: str, device: str, x: torch.Tensor, dy: torch.Tensor):
    r = build_recipe(RecipeConfig(precision=precision, amp_impl="native", fp8_impl=impl), device=device)
    torch.manual_seed(1)
    m = r.convert_module(nn.Sequential(nn.Linear(512, 512)))
    xi = x.to(device).requires_grad_()
    with r.autocast():
        y = m(xi)
    y.backward(dy.to(device, y.dtype))
    return r, (y.float().cpu(), xi.grad.float().cpu(), m[0].weight.grad.float().cpu())


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("lowp_gpu_check.py: no CUDA device")
    torch.manual_seed(0)
    x, dy = torch.randn(256, 512), torch.randn(256, 512) * 1e-3
    for precision in ("fp8-mixed", "fp8-rowwise", "mxfp8", "mxfp4", "nvfp4"):
        for impl in ("scratch", "torchao"):
            try:
                _, cpu = run(precision, impl, "cpu", x, dy)
                r, gpu = run(precision, impl, "cuda", x, dy)
            except UsageError as e:
                print(f"{precision} [{impl}]: not run: {e}")
                continue
            rel = " ".join(f"{float((a - b).norm() / b.norm()):.2e}" for a, b in zip(gpu, cpu))
            print(f"{precision} [{impl}] real={r.fp8.real()}: y/dx/dW relative to the CPU emulation {rel}")


if __name__ == "__main__":
    main()
