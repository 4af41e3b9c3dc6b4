"""The examples in examples/ run as the README says (the transformers one only where it is installed)."""

import pytest

from conftest import ROOT, run_cli_subprocess

EX = ROOT / "examples"

pytestmark = pytest.mark.slow  # each example trains end to end through the CLI


def test_own_model_example_trains_from_the_cli(cli):
    f = EX / "own_model.py"
    code, out, err = cli("train", "--model", f"{f}:make_model", "--dataset", f"{f}:make_data", "--max-steps", "4",
                         "--epochs", "1", "--log-every", "0", "--progress", "off", "--precision", "bf16-mixed")
    assert code == 0, err


def test_hf_example_trains_gpt2_on_text():
    """In a fresh process, as a user runs it: importing transformers imports torchao, whose load-time warnings
    (extensions it cannot load, pytree deprecations) stay out of mixprec's output."""
    pytest.importorskip("transformers")
    f = EX / "hf_transformer.py"
    r = run_cli_subprocess("train", "--model", f"{f}:make_gpt2", "--dataset", "text", "--block-size", "32",
                           "--max-steps", "3", "--epochs", "1", "--limit-test", "8", "--log-every", "0",
                           "--progress", "off", "--precision", "bf16-mixed", "--optimizer", "adamw", "--lr", "1e-3")
    assert r.returncode == 0, r.stderr
    assert "bits/char" in r.stdout
    assert "Failed to load" not in r.stderr + r.stdout and "_pytree" not in r.stderr + r.stdout, r.stderr


def test_the_readmes_notebook_example_runs_as_written():
    import re
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- notebook example -->\n```python\n(.*?)```", text, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    loss, acc = r.stdout.splitlines()[-2].split()
    assert float(loss) > 0 and 0.5 < float(acc) <= 1 and "verdict on h100-sxm" in r.stdout
