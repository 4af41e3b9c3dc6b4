"""Issue 33's demonstrations of ``mixprec tune``, end to end, with the figures benchmarks/README.md and the README
quote: for each model, the tuned file's planned step time on the target beside every uniform recipe's, and a short
CPU bench (fp32 seeds, each uniform recipe, the tuned file) whose parity column says whose loss stays in fp32's band.

    python benchmarks/tune_demo.py [--only gpt,llama,spiky] [--steps 30] [--out runs/tune_demo]

Models: a nanoGPT-shaped GPT of width 1024 (1 block), a small Hugging Face Llama (hidden 1024, 1 layer) on the
``text`` corpus, priced on an h100-sxm at 32 x 64 tokens per step; the outlier model of tests/userpkg/spiky.py
on digits (candidates fp8-mixed and bf16-mixed, ``--min-gain 0``: the numerics alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

LLAMA = ROOT / "benchmarks" / "_tune_llama.py"
LLAMA_SRC = '''from transformers import LlamaConfig, LlamaForCausalLM


def make(vocab_size, block_size):
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=1024, intermediate_size=2816,
                                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                                        max_position_embeddings=block_size))
'''

TEXT = dict(dataset="text", block_size=64, batch_size=4, optimizer="adamw", lr=1e-3)
MODELS = {
    "gpt": dict(flags=dict(model="gpt", d_model=1024, n_layers=1, n_heads=8, **TEXT), plan_batch=32,
                recipes=["bf16-mixed", "fp8-mixed", "fp8-rowwise"], tune=dict()),
    "llama": dict(flags=dict(model=f"{LLAMA}:make", **TEXT), plan_batch=32,
                  recipes=["bf16-mixed", "fp8-mixed", "fp8-rowwise"], tune=dict()),
    "spiky": dict(flags=dict(model=f"{ROOT / 'tests' / 'userpkg' / 'spiky.py'}:model", dataset="digits",
                             batch_size=64, optimizer="adamw", lr=3e-3), plan_batch=None,
                  recipes=["bf16-mixed", "fp8-mixed"], tune=dict(candidates="fp8-mixed,bf16-mixed", min_gain=0)),
}


def _flags(d: dict) -> list[str]:
    return [x for k, v in d.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each bench run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--target", default="h100-sxm")
    p.add_argument("--out", default=str(ROOT / "runs" / "tune_demo"))
    args = p.parse_args()
    import mixprec
    from mixprec.cli import main as cli
    from mixprec.tune import tune

    LLAMA.write_text(LLAMA_SRC)
    os.makedirs(args.out, exist_ok=True)
    lines = []
    try:
        for name in args.only.split(","):
            m = MODELS[name]
            out = Path(args.out) / name
            out.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            f = str(out / "layer-formats.json")
            t = tune(target=args.target, steps=2, plan_batch_size=m["plan_batch"], out=f, **m["tune"], **m["flags"])
            tuned_s = time.time() - t0
            counts: dict[str, int] = {}
            for c in t.layers:
                counts[c.format] = counts.get(c.format, 0) + 1
            plan_flags = {**m["flags"], "batch_size": m["plan_batch"] or m["flags"]["batch_size"]}
            plan = mixprec.plan(precisions=m["recipes"], target=args.target, layer_formats=f, **plan_flags)
            planned = {r.label.split(" [")[0]: r.step_time_s for r in plan.recipes}
            code = cli(["bench", *_flags(m["flags"]), "--precisions", ",".join(["fp32"] + m["recipes"]),
                        "--layer-formats", f, "--repeats", str(args.repeats), "--max-steps", str(args.steps),
                        "--epochs", "100", "--warmup-steps", "1", "--no-plots", "--no-plan",
                        "--out", str(out / "bench"), "--limit-test", "256"])
            rows = json.loads((out / "bench" / "results.json").read_text())["summary"]
            parity = {r["recipe"]: (r.get("parity") or {}).get("verdict") for r in rows}
            loss = {r["recipe"]: r.get("final_train_loss") for r in rows}
            lines.append(f"### {name} (tune {tuned_s:.0f} s; layers: "
                         + ", ".join(f"{n} {f}" for f, n in sorted(counts.items())) + f"; bench exit {code})")
            lines.append("| entry | planned step on " + args.target + " | final train loss (CPU) | in fp32's band |")
            lines.append("|---|---|---|---|")
            for label, s in planned.items():
                key = label if label in parity else next((k for k in parity if k.endswith("+layers")), label)
                lines.append(f"| {label} | {s * 1e3:.3f} ms | {loss.get(key, float('nan')):.4f} | {parity.get(key)} |")
            lines.append(f"| fp32 | — | {loss.get('fp32', float('nan')):.4f} | (the band) |")
            lines.append("")
            print("\n".join(lines[-(len(planned) + 5):]), flush=True)
    finally:
        LLAMA.unlink(missing_ok=True)
    (Path(args.out) / "summary.md").write_text("\n".join(lines))
    print(f"wrote {Path(args.out) / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
