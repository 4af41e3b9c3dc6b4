"""--compile: same training as eager (up to kernel fusion), compile time apart, scratch autocast refused."""

import pytest

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
