"""Issue 12's proof on real text: the GPT on `fortunes`, bf16-mixed and fp16-mixed against fp32's seed band."""

import json
import os

import pytest

FORTUNES = "/usr/share/games/fortunes"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(FORTUNES), reason="the Debian package fortunes is not installed")
def test_gpt_on_fortunes_low_precision_matches_fp32(cli, tmp_path):
    out = tmp_path / "b"
    code, stdout, err = cli("bench", "--model", "gpt", "--dataset", "text", "--n-layers", "2", "--n-heads", "4",
                            "--d-model", "64", "--block-size", "32", "--batch-size", "32", "--optimizer", "adamw",
                            "--lr", "1e-3", "--max-steps", "80", "--limit-test", "128", "--warmup-steps", "3",
                            "--precisions", "fp32,bf16-mixed,fp16-mixed", "--repeats", "2", "--no-plots",
                            "--peak-seconds", "0.2", "--no-plan", "--out", out)
    assert code == 0, stdout + err
    assert "test loss / bits per char" in stdout
    doc = json.loads((out / "results.json").read_text())
    rows = {r["recipe"]: r for r in doc["summary"]}
    band = rows["fp32"]["test_loss"]
    width = max(band["max"] - band["min"], 0.02)  # two seeds: a band at least 0.02 nats wide
    for recipe in ("bf16-mixed", "fp16-mixed"):
        r = rows[recipe]
        assert r["language_model"] and r["parity"]["verdict"] == "yes", r["parity"]
        assert band["min"] - width <= r["test_loss"]["median"] <= band["max"] + width, (recipe, r["test_loss"], band)
        assert 2.0 < r["bits_per_char"]["median"] < 6.0  # learning, from log2(113) = 6.8 at random
