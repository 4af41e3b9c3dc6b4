"""Regenerate golden_losses.json: `python tests/golden/regen.py` (only after an intended numerics change)."""

import json
from pathlib import Path

from mixprec.train.config import TrainConfig
from mixprec.train.loop import train

GOLDEN = Path(__file__).with_name("golden_losses.json")
CONFIG = dict(dataset="digits", model="mlp", width=64, depth=1, batch_size=32, max_steps=30, epochs=1,
              lr=0.1, momentum=0.9, seed=0, log_every=0, progress="off", amp_impl="native")
RECIPES = ("fp32", "bf16-mixed")


def losses(precision: str) -> list[float]:
    result = train(TrainConfig.from_flags(**CONFIG, precision=precision))
    return [x for h in result.history for x in h["loss_curve"]]


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({"config": CONFIG, "losses": {r: losses(r) for r in RECIPES}}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
