"""Emulated FP8 linear layers against bf16 autocast and fp32, on CPU: step time, side by side.

What is compared (same weights, same batch, forward + backward; ``--what step`` adds an SGD step):

- ``fp32``: the plain layer / MLP;
- ``bf16``: the same under ``torch.autocast("cpu", torch.bfloat16)`` (what the bf16-mixed recipe runs);
- ``fp8``: the fp8-mixed recipe's model -- :func:`mixprec.lowp.convert.convert_to_fp8` under the same bf16 autocast --
  with today's emulation (FP8 values as bf16, bf16 GEMMs with fp32 accumulation);
- ``fp8-ref``: the same model on the former emulation (FP8 dtype casts, fp32 GEMMs), which the tests keep as
  the reference the new path must match.

Two workloads: ``linear`` (one 784 -> 512 layer on a batch of 256, the MLP's largest GEMMs) and ``mlp``
(mixprec's ``mlp`` model at 784 -> 512 -> 512 -> 10, batch 256: two FP8 layers, the 10-way head stays bf16).

Method: each variant warms up, then the variants take turns in rounds (order rotated every round); each turn
times ``--iters`` iterations. The result per variant is the median over rounds of its time per iteration
divided by ``bf16``'s in the same round: a ratio measured side by side, robust to the machine getting faster
or slower between rounds. The load average (``os.getloadavg``) is printed before and after: on a shared
machine, trust the ratios only when it stays below the number of threads used. Target (issue 13): fp8 / bf16
<= 1.15 on the MLP.

``python benchmarks/fp8_gemm.py`` (about a minute); ``--profile`` prints torch.profiler's op table for ``fp8``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.lowp import fp8
from mixprec.lowp.convert import convert_to_fp8
from mixprec.train.models import build_model

VARIANTS = ("fp32", "bf16", "fp8", "fp8-ref")


class _ReferenceFp8Linear(fp8.Fp8Linear):
    """Fp8Linear on the former emulation (FP8 dtype casts and fp32 GEMMs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8._linear(x, self.weight, self.bias, "reference")


def _models(what: str) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    if what == "linear":
        base: nn.Module = nn.Linear(784, 512)
    else:
        base = build_model("mlp", input_shape=(1, 28, 28), num_classes=10, width=512, depth=2)
    fp8_model = convert_to_fp8(copy.deepcopy(base), emulate=True)
    ref_model = convert_to_fp8(copy.deepcopy(base), emulate=True)
    for m in ref_model.modules():
        if type(m) is fp8.Fp8Linear:
            m.__class__ = _ReferenceFp8Linear
    if type(ref_model) is fp8.Fp8Linear:
        ref_model.__class__ = _ReferenceFp8Linear
    return {"fp32": base, "bf16": copy.deepcopy(base), "fp8": fp8_model, "fp8-ref": ref_model}


def _step_fn(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, with_opt: bool):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if with_opt else None
    autocast = name != "fp32"
    classify = y is not None

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
            loss = F.cross_entropy(out, y) if classify else out.float().square().mean()
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    return step


def measure(what: str, rounds: int, iters: int, with_opt: bool) -> dict[str, dict[str, list[float]]]:
    models = _models(what)
    g = torch.Generator().manual_seed(0)
    if what == "linear":
        x, y = torch.randn(256, 784, generator=g), None
    else:
        x, y = torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)
    steps = {n: _step_fn(n, models[n], x, y, with_opt) for n in VARIANTS}
    for s in steps.values():  # warm-up: oneDNN primitive caches, allocator
        for _ in range(3):
            s()
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in VARIANTS} for c in ("wall", "cpu")}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for n in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                steps[n]()
            times["wall"][n].append((time.perf_counter() - t0) / iters)
            times["cpu"][n].append((time.process_time() - c0) / iters)
    return times


def report(what: str, times: dict[str, dict[str, list[float]]]) -> None:
    print(f"\n{what}: median time per iteration, and median over rounds of (time / bf16 time in that round); "
          "wall clock, and this process's CPU time (with one thread: the work, less sensitive to other load)")
    for n in VARIANTS:
        cols = []
        for clock in ("wall", "cpu"):
            ratios = [t / b for t, b in zip(times[clock][n], times[clock]["bf16"])]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            cols.append(f"{clock} {statistics.median(times[clock][n]) * 1e3:7.3f} ms {statistics.median(ratios):6.3f}x "
                        f"({q[0]:.2f}..{q[2]:.2f})")
        print(f"  {n:8s} " + "   ".join(cols))


def profile(what: str, with_opt: bool) -> None:
    from torch.profiler import profile as torch_profile

    models = _models(what)
    x = torch.randn(256, 784) if what == "linear" else torch.randn(256, 1, 28, 28)
    y = None if what == "linear" else torch.randint(0, 10, (256,))
    for name in ("fp8", "bf16"):
        step = _step_fn(name, models[name], x, y, with_opt)
        for _ in range(3):
            step()
        with torch_profile() as prof:
            for _ in range(20):
                step()
        print(f"\n{what} {name}: torch.profiler, 20 iterations")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("linear", "mlp", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--step", action="store_true", help="include an SGD step (the default is forward + backward)")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), oneDNN bf16: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, load average before: {os.getloadavg()}")
    for what in (("linear", "mlp") if a.what == "both" else (a.what,)):
        if a.profile:
            profile(what, a.step)
        else:
            report(what, measure(what, a.rounds, a.iters, a.step))
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
