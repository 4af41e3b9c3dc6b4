"""The planner's GPU step time against measured `mixprec bench` runs, and the fit of its host constants.

Replans every recipe of each run (a `mixprec bench` output folder with `results.json`) on the run's target, from
the config the run stored (its data swapped for synthetic samples of the same shape: the plan needs shapes only),
and prints measured, planned before (the `prediction` the run stored) and planned now, per recipe.

    PYTHONPATH=src python benchmarks/gpu_step_time.py                  # the three H200 runs, a table
    PYTHONPATH=src python benchmarks/gpu_step_time.py --fit demo_cnn,mlp_lowp   # refit the three constants

`--fit` refits `planning.roofline`'s OP_HOST_S, MODULE_HOST_S and TORCHAO_LAYER_S on the named runs (least squares on
log(planned / measured), scipy) and prints every run's error with them; copy them into roofline.py by hand.
`--leave-one-out` fits on every pair of runs and checks the third. `--gemm-bound` plans the GEMM-bound model of
the H200 session (4 x Linear(8192, 8192) + GELU, batch 8192) eager and compiled beside its measured times (no run
folder: ../shared/gpu/README.md's table, copied below), a check of the compiled model. benchmarks/README.md
("GPU step time") has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS_DIR = os.path.join(HERE, "h200-2026-12-04")
RUNS = ("demo_cnn", "bench_tf", "mlp_lowp")
TARGET = "h200"


def load_run(path: str) -> dict:
    """What the planner needs of one bench folder's results.json: the measured and the stored planned step times,
    the config, and which recipes ran torchao's layers (their description says so)."""
    with open(os.path.join(path, "results.json"), encoding="utf-8") as f:
        doc = json.load(f)
    measured = {r["recipe"]: r["timing"]["step_time_s"] for r in doc["runs"] if r.get("timing")}
    torchao = {r["recipe"]: "torchao's training layers" in str(r.get("describe")) for r in doc["runs"]}
    before = {name: r.get("step_time_s") for name, r in (doc.get("prediction") or {}).get("recipes", {}).items()}
    recipes = [name for name in doc["configs"] if name in measured]
    return {"measured": measured, "before": before, "config": doc["configs"][recipes[0]], "recipes": recipes,
            "torchao": torchao}


def planner_for(config: dict, target: str = TARGET):
    """A Planner of the run's config, its data swapped for synthetic samples of the same shape."""
    from mixprec.planning.api import Planner
    from mixprec.train.config import TrainConfig

    cfg = TrainConfig.from_dict(config)
    shape = (1, 28, 28) if cfg.data.name in ("fashion-mnist", "mnist") else cfg.data.synthetic_shape
    data = dataclasses.replace(cfg.data, name="synthetic", data_dir=None, synthetic_shape=shape,
                               synthetic_train=cfg.optim.batch_size, synthetic_test=64, limit_train=None,
                               limit_test=None)
    recipe = cfg.recipe
    if "fp8_layers" not in config["recipe"]:  # a run from before --fp8-layers converted every eligible layer
        recipe = dataclasses.replace(recipe, fp8_layers="all")
    return Planner(config=dataclasses.replace(cfg, data=data, recipe=recipe), target=target)


@dataclasses.dataclass
class Traced:
    run: str
    recipe: str
    measured: float
    before: float | None
    trace: object
    tf32: bool
    execution: object


def trace_runs(runs_dir: str, runs, recipes: dict[str, list[str]] | None = None) -> list[Traced]:
    """Every recipe of every run traced once on the target (``recipes``: only these, per run), priced as it ran:
    torchao's layers where its description says so, whatever this machine has installed."""
    out = []
    for run in runs:
        r = load_run(os.path.join(runs_dir, run))
        planner = planner_for(r["config"])
        for name in (recipes or {}).get(run, r["recipes"]):
            tr, _, tf32 = planner.trace(name)
            execution = dataclasses.replace(planner.execution(tr), torchao=r["torchao"][name])
            out.append(Traced(run, name, r["measured"][name], r["before"].get(name), tr, tf32, execution))
    return out


def planned(t: Traced, op_host_s=None, module_host_s=None, torchao_layer_s=None) -> float:
    """The step time of a traced recipe on the target, with the constants given (else roofline.py's)."""
    from mixprec.planning import roofline as R
    from mixprec.planning.targets import get_target

    target = get_target(TARGET)
    given = (("op_s", op_host_s), ("module_s", module_host_s), ("torchao_layer_s", torchao_layer_s))
    host = dataclasses.replace(R.GPU_HOST, **{k: v for k, v in given if v is not None})
    dtype_map = {"fp32": "tf32"} if t.tf32 and "tf32" in target.peak_flops else {}
    return R.step_time(t.trace.ops, target, dtype_map=dtype_map, execution=t.execution, host=host).total_s


def fit(traced: list[Traced]) -> tuple[float, float, float]:
    """(op_host_s, module_host_s, torchao_layer_s) minimising the squared log errors over ``traced``."""
    try:
        from scipy.optimize import least_squares
    except ImportError:
        sys.exit("gpu_step_time.py --fit needs scipy: pip install scipy")

    def residuals(p):
        return [math.log(planned(t, p[0] * 1e-6, p[1] * 1e-6, p[2] * 1e-3) / t.measured) for t in traced]

    r = least_squares(residuals, [15.0, 100.0, 3.0], bounds=([0.0, 0.0, 0.0], [1e3, 1e4, 1e2]), diff_step=1e-2)
    return r.x[0] * 1e-6, r.x[1] * 1e-6, r.x[2] * 1e-3


def table(traced: list[Traced], **constants) -> list[str]:
    lines = ["| run | recipe | measured | planned before | planned now | now / measured |", "|---|---|---|---|---|---|"]
    for t in traced:
        now = planned(t, **constants)
        before = f"{t.before * 1e3:.3g} ms" if t.before else "?"
        lines.append(f"| {t.run} | {t.recipe} | {t.measured * 1e3:.3g} ms | {before} | {now * 1e3:.3g} ms | "
                     f"{now / t.measured:.2f} ({100 * (now / t.measured - 1):+.0f}%) |")
    return lines


GEMM_BOUND_MEASURED_MS = {  # H200, torch 2.11, mixprec's recipes (compiled bf16: raw torch's), ms per step
    (False, "fp32"): 236.4, (False, "tf32"): 42.4, (False, "bf16-mixed"): 21.1, (False, "fp8-mixed"): 37.9,
    (False, "fp8-rowwise"): 38.2, (True, "bf16-mixed"): 20.6, (True, "fp8-mixed"): 14.7, (True, "fp8-rowwise"): 17.0,
}


def gemm_bound() -> list[str]:
    """The GEMM-bound model planned eager and compiled, its FP8 layers priced as torchao's (as the session ran)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from mixprec.planning.api import Planner
    from mixprec.train.config import TrainConfig

    def model():
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8192, 8192), nn.GELU())])

    batch = (torch.zeros(8192, 8192), torch.zeros(8192, 8192))
    lines = ["| recipe | compiled | measured | planned | planned / measured |", "|---|---|---|---|---|"]
    for compiled in (False, True):
        config = TrainConfig.from_flags(optimizer="sgd", lr=0.01, amp_impl="native",
                                        compile="on" if compiled else "off")
        planner = Planner(config=config, target=TARGET, model=model, batch=batch, loss_fn=F.mse_loss)
        for name in (n for c, n in GEMM_BOUND_MEASURED_MS if c == compiled):
            tr, _, tf32 = planner.trace(name)
            execution = dataclasses.replace(planner.execution(tr), torchao=tr.lowp_layers > 0)
            measured = GEMM_BOUND_MEASURED_MS[(compiled, name)] / 1e3
            s = planned(Traced("gemm-bound", name, measured, None, tr, tf32, execution))
            lines.append(f"| {name} | {'yes' if compiled else 'no'} | {measured * 1e3:.3g} ms | {s * 1e3:.3g} ms | "
                         f"{s / measured:.2f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs-dir", default=RUNS_DIR)
    ap.add_argument("--fit", help="comma-separated runs to fit the constants on (e.g. demo_cnn,mlp_lowp)")
    ap.add_argument("--leave-one-out", action="store_true", help="fit on each pair of runs, check the third")
    ap.add_argument("--gemm-bound", action="store_true", help="the H200 session's GEMM-bound model, eager and compiled")
    args = ap.parse_args(argv)
    if args.gemm_bound:
        print("\n".join(gemm_bound()))
        return 0
    traced = trace_runs(args.runs_dir, RUNS)
    if args.leave_one_out:
        for held in RUNS:
            c = fit([t for t in traced if t.run != held])
            worst = max(abs(planned(t, *c) / t.measured - 1) for t in traced if t.run == held)
            print(f"held out {held}: op {c[0] * 1e6:.3g} us, module {c[1] * 1e6:.3g} us, torchao layer "
                  f"{c[2] * 1e3:.3g} ms; worst held-out error {100 * worst:.0f}%")
        return 0
    constants = {}
    if args.fit:
        names = args.fit.split(",")
        c = fit([t for t in traced if t.run in names])
        constants = dict(op_host_s=c[0], module_host_s=c[1], torchao_layer_s=c[2])
        print(f"fitted on {', '.join(names)}: OP_HOST_S = {c[0]:.3g}, MODULE_HOST_S = {c[1]:.3g}, "
              f"TORCHAO_LAYER_S = {c[2]:.3g}")
    print("\n".join(table(traced, **constants)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
