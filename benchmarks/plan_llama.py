"""Plan a Llama-3-8B training step (Hugging Face ``LlamaConfig``, no weights) at 1 x 2048 tokens.

    PYTHONPATH=src python benchmarks/plan_llama.py --target h100-sxm --precisions fp32,bf16-mixed,fp8-mixed

Prints the plan, the wall time and the peak RSS of this process (the issue's budget: under two minutes and
3 GB for the three recipes), and the hand calculation of parameter, gradient and AdamW-state bytes beside
the plan's (they must match exactly). ``tests/test_plan.py::test_llama_8b_plan`` runs it (slow).
``--optimizer sgd``: mixprec's default optimizer, whose fused step has no fake kernel in PyTorch
(``mixprec.planning.trace.NO_FAKE_KERNEL``); no hand calculation then.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA3_8B, **overrides})


def llama_factory(config):
    def build():
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(config)

    build.__name__ = f"LlamaForCausalLM({config.num_hidden_layers} layers, d={config.hidden_size})"
    return build


def hand_count(c) -> int:
    """Parameters of a Llama, from its config: embeddings, per layer q/k/v/o, gate/up/down, two RMSNorms,
    the final norm and the untied LM head."""
    d, f, v, n = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    kv = d // c.num_attention_heads * c.num_key_value_heads
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d
    return v * d + n * per_layer + d + (0 if c.tie_word_embeddings else v * d)


def hand_bytes(n_params: int, recipe: str) -> dict[str, int]:
    """Parameter, gradient and AdamW state bytes of a recipe (fused AdamW: exp_avg, exp_avg_sq per parameter in
    the parameters' dtype, plus one fp32 step counter per parameter tensor, counted apart)."""
    low = recipe in ("bf16-true", "bf16-master", "fp16-master")
    p = 2 if low else 4
    return {"parameters": n_params * p, "gradients": n_params * (4 if recipe.endswith("-master") else p),
            "adam_moments": 2 * n_params * (4 if recipe.endswith("-master") or not low else 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100-sxm")
    ap.add_argument("--precisions", default="fp32,bf16-mixed,fp8-mixed")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from mixprec.planning import plan
    from mixprec.planning.report import format_plan, write_json

    cfg = llama_config(**({"num_hidden_layers": args.layers} if args.layers else {}))
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    t0 = time.perf_counter()
    p = plan(precisions=args.precisions, target=args.target, model=llama_factory(cfg),
             batch={"input_ids": ids, "labels": ids}, optimizer=args.optimizer, lr=1e-4)
    wall = time.perf_counter() - t0
    print(format_plan(p))
    n = hand_count(cfg)
    print(f"\nhand calculation: {n:,} parameters")
    for r in p.recipes if args.optimizer == "adamw" else ():
        h = hand_bytes(n, r.recipe)
        steps = r.memory["optimizer_state"] - h["adam_moments"]
        print(f"  {r.recipe:12s} parameters {h['parameters']:,} (plan {r.memory['parameters']:,}), gradients "
              f"{h['gradients']:,} (plan {r.memory['gradients']:,}), AdamW moments {h['adam_moments']:,} + "
              f"{steps} B of step counters (plan {r.memory['optimizer_state']:,})")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nplanned {len(p.recipes)} recipes in {wall:.1f} s, peak RSS {rss:.2f} GB")
    if args.json:
        write_json(p, args.json)


if __name__ == "__main__":
    main()
