"""--compile: same training as eager (up to kernel fusion), compile time apart, scratch autocast refused."""

import pytest
import torch

from mixprec.train.config import TrainConfig
from mixprec.train.loop import train

FLAGS = dict(dataset="digits", model="mlp", width=64, depth=1, batch_size=100, epochs=1, log_every=0,
             progress="off", precision="bf16-mixed")


@pytest.mark.slow
def test_compiled_run_matches_eager_and_reports_compile_time_apart():
    eager = train(TrainConfig.from_flags(**FLAGS))
    compiled = train(TrainConfig.from_flags(**FLAGS, compile=True))
    a, b = eager.history[0]["loss_curve"], compiled.history[0]["loss_curve"]
    assert len(a) == len(b) == 15  # 1438 samples / 100: the last, smaller batch was compiled before the clock
    assert all(abs(x - y) <= 1e-2 * abs(x) for x, y in zip(a, b))
    assert compiled.summary["compile_time_s"] > 0 and eager.summary["compile_time_s"] is None
    # the epoch time excludes compilation: no step of the compiled epoch takes the compile time
    assert max(compiled.history[0]["step_times_s"]) < compiled.summary["compile_time_s"]


def test_scratch_autocast_refuses_compile(cli):
    code, _, err = cli("train", "--dataset", "digits", "--max-steps", "1", "--precision", "bf16-mixed",
                       "--amp-impl", "scratch", "--compile")
    assert code == 2 and "--amp-impl native" in err and "Traceback" not in err


# -- --compile auto|on|off -----------------------------------------------------------------------------------------

def test_compile_flag_spellings():
    from mixprec.cli import build_parser
    from mixprec.train.args import typed_flags

    parse = build_parser().parse_args
    assert typed_flags(parse(["train", "--compile"]))["compile"] == "on"
    assert typed_flags(parse(["train", "--compile", "off"]))["compile"] == "off"
    assert "compile" not in typed_flags(parse(["train"])) and TrainConfig().run.compile == "auto"
    # configs stored before auto existed held a bool
    assert TrainConfig.from_dict({"run": {"compile": True}}).run.compile == "on"
    assert TrainConfig.from_dict({"run": {"compile": False}}).run.compile == "off"
    with pytest.raises(SystemExit) as e:  # argparse's own refusal, as for every choice flag
        parse(["train", "--compile", "sometimes"])
    assert e.value.code == 2


@pytest.mark.parametrize("recipe, device, units, expected", [
    ("fp8-mixed", "cuda", True, True),      # real FP8 GEMMs: compiled
    ("fp8-rowwise", "cuda", True, True),
    ("fp8-mixed", "cuda", False, False),    # emulated GEMMs (no FP8 units): eager
    ("bf16-mixed", "cuda", True, False),    # not an FP8/FP4 recipe
    ("fp8-mixed", "cpu", False, False),     # a CPU compiles nothing by default
    ("nvfp4", "cpu", False, False),
])
def test_auto_compiles_the_fp8_recipes_on_cuda_where_their_gemms_are_real(recipe, device, units, expected):
    from mixprec.hardware import Capabilities, capabilities
    from mixprec.precision import build_recipe

    caps = (Capabilities(torch.device("cuda"), "H100", tf32=True, fast_bf16=True, fast_fp16=True,
                         fast_fp16_training=True, fp8_matmul=units, rowwise_fp8=units) if device == "cuda"
            else capabilities("cpu"))
    options = {"fp8_impl": "scratch"} if recipe != "bf16-mixed" else {}  # torchao is picked only where installed
    r = build_recipe(recipe, device=device, for_target=device == "cuda", capabilities=caps, **options)
    compiles, why = r.compiles("auto")
    assert compiles is expected
    assert ("compiled" in why) if expected else (why == "" or "eager" in why)
    assert r.compiles("on") == (True, "") and r.compiles("off") == (False, "")


@pytest.mark.slow
def test_a_run_stores_the_resolved_compile_and_a_resume_compares_it(tmp_path):
    from mixprec.errors import CheckpointError
    from mixprec.train.build import build_run
    from mixprec.train.resume import resume_config

    flags = dict(FLAGS, precision="fp8-mixed", max_steps=2, out=str(tmp_path / "r"))
    run = build_run(TrainConfig.from_flags(**flags))
    assert run.config.run.compile == "off"  # auto on a CPU: nothing compiles
    train(run)
    assert resume_config({"resume": str(tmp_path / "r"), "compile": "auto"}).run.compile == "auto"
    with pytest.raises(CheckpointError, match="--compile 'off' in the checkpoint vs 'on' now"):
        resume_config({"resume": str(tmp_path / "r"), "compile": "on"})
