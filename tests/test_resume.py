"""`mixprec train --resume DIR`: the run continues with its own config; typed flags may change only what a
resume may change, compared after normalising aliases and by the mechanism they resolve to, and a refused
resume builds nothing. Most checks read a checkpoint an older mixprec wrote (tests/fixtures), so they need no
training."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import mixprec.train.build as build_mod
from mixprec.cli import build_parser
from mixprec.errors import CheckpointError, ConfigError
from mixprec.precision import build_recipe
from mixprec.train.args import typed_flags
from mixprec.train.build import build_run
from mixprec.train.checkpoint import load_checkpoint, mechanism, save_checkpoint
from mixprec.train.config import TrainConfig
from mixprec.train.resume import RESUME_MAY_CHANGE, resume_config

FIXTURE = Path(__file__).parent / "fixtures" / "main_d16a38d_bf16_digits_mlp.pt"
"""Written by main at d16a38d: `--precision bf16 --dataset digits --model mlp --width 8 --depth 1 --batch-size 256
--epochs 2 --max-steps 3 --log-every 0 --progress off --out run` (see tests/fixtures/README.md)."""


@pytest.fixture
def saved(tmp_path):
    """A copy of the fixture checkpoint in ``tmp_path/run`` (its stored ``--out``); returns the folder."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE, run / "last.pt")
    return run


def _crafted(tmp_path, *, config: dict, mech: dict | None) -> Path:
    """The fixture with another stored config / mechanism (for the checks that read only those)."""
    ck = torch.load(FIXTURE, weights_only=True)
    ck = {k: v for k, v in ck.items() if k not in ("format", "version", "digest")}
    ck["config"] = config
    if mech is not None:
        ck["mechanism"] = mech
    save_checkpoint(tmp_path / "crafted" / "last.pt", ck)
    return tmp_path / "crafted"


def test_a_resume_takes_the_checkpoints_config_and_only_the_typed_flags(saved):
    stored = TrainConfig.from_dict(torch.load(saved / "last.pt", weights_only=True)["config"])
    config = resume_config({"resume": str(saved), "epochs": 7, "log_every": 2})
    # the run continues where its checkpoint is (the fixture stored --out run, as first typed)
    assert config == stored.with_flags(epochs=7, log_every=2, resume=str(saved), overwrite=False, out=str(saved))
    assert stored.run.out == "run"
    assert config.recipe.precision == "bf16-mixed"  # the fixture stored the alias it was given: bf16
    assert (config.model.width, config.optim.batch_size, config.optim.max_steps) == (8, 256, 3)


@pytest.mark.parametrize("spelling", ["bf16", "bf16-mixed", "BF16"])
def test_recipe_aliases_are_the_same_run(saved, spelling):
    assert resume_config({"resume": str(saved), "precision": spelling}).recipe.precision == "bf16-mixed"


@pytest.mark.parametrize("typed, named", [
    ({"precision": "fp16-mixed"}, "--precision 'bf16-mixed' in the checkpoint vs 'fp16-mixed' now"),
    ({"lr": 0.5}, "--lr 0.01 in the checkpoint vs 0.5 now"),
    ({"batch_size": 32}, "--batch-size 256 in the checkpoint vs 32 now"),
    ({"seed": 1}, "--seed 0 in the checkpoint vs 1 now"),
    ({"width": 16}, "--width 8 in the checkpoint vs 16 now"),
    ({"compile": True}, "--compile 'off' in the checkpoint vs 'on' now"),
    ({"compile": "on"}, "--compile 'off' in the checkpoint vs 'on' now"),
    ({"amp_impl": "scratch"}, "--amp-impl 'auto' in the checkpoint vs 'scratch' now (bf16-mixed would run with "
                              "impl scratch instead of native)"),
    ({"lr_schedule": "cosine"}, "--lr-schedule 'constant' in the checkpoint vs 'cosine' now"),
    ({"lr_warmup_steps": 5}, "--lr-warmup-steps 0 in the checkpoint vs 5 now"),
    ({"optimizer": "adamw"}, "--optimizer 'sgd' in the checkpoint vs 'adamw' now"),
])
def test_a_change_of_numerics_is_refused_naming_the_flag_and_both_values(saved, typed, named):
    with pytest.raises(CheckpointError) as e:
        resume_config({"resume": str(saved), "epochs": 4, **typed})
    assert named in str(e.value) and "\n" not in str(e.value)


def test_every_refused_flag_is_named_at_once(saved):
    with pytest.raises(CheckpointError) as e:
        resume_config({"resume": str(saved), "lr": 0.5, "seed": 2, "momentum": 0.9, "epochs": 9})
    msg = str(e.value)
    assert all(f in msg for f in ("--lr 0.01", "--seed 0", "--momentum 0.0")) and "--epochs" not in msg.split(".")[0]


MAY_CHANGE_VALUES = {
    "epochs": 9, "max_steps": None, "out": "elsewhere", "checkpoint_every": 2, "resume": None, "overwrite": True,
    "metrics_json": "m.json", "log_every": 1, "eval_every": 7, "progress": "on", "data_dir": "/data", "data_path": "/text",
    "num_workers": 2, "limit_test": 10, "check_consistency": 5, "max_consecutive_skips": 3, "watch": 4,
}


def test_every_flag_a_resume_may_change_is_accepted(saved):
    assert set(MAY_CHANGE_VALUES) == set(RESUME_MAY_CHANGE)  # a new entry needs a value here
    for flag, value in MAY_CHANGE_VALUES.items():
        typed = {"resume": str(saved), flag: value} if flag != "resume" else {"resume": str(saved)}
        config = resume_config(typed)
        assert config.flags()[flag] == (value if flag != "resume" else str(saved)), flag


def test_device_may_change_where_the_mechanism_stays(saved):
    """bf16-mixed resolves to native bf16 on every device, so --device cpu continues a run of --device auto."""
    config = resume_config({"resume": str(saved), "device": "cpu"})
    assert config.run.device == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resume_config({"resume": str(saved), "device": "cuda"})


def test_device_change_that_changes_what_auto_picks_is_refused(tmp_path):
    """A fp16-mixed run on a GPU (native fp16) moved to this CPU: auto picks the scratch engine's emulation on
    a CPU, a different run."""
    gpu_like = mechanism(build_recipe("fp16-mixed", device="cpu", amp_impl="native"))  # native fp16, as on CUDA
    assert gpu_like["impl"] == "native" and gpu_like["matmul_dtype"] == "fp16"
    stored = TrainConfig.from_flags(precision="fp16-mixed", dataset="digits", model="mlp", device="cuda")
    path = _crafted(tmp_path, config=stored.to_dict(), mech=gpu_like)
    with pytest.raises(CheckpointError, match=r"--device 'cuda' in the checkpoint vs 'cpu' now \(fp16-mixed "
                                              r"would run with impl scratch instead of native"):
        resume_config({"resume": str(path), "device": "cpu"})


def test_a_machine_where_auto_resolves_differently_is_refused_even_without_flags(tmp_path):
    stored = TrainConfig.from_flags(precision="bf16-mixed", dataset="digits", model="mlp")
    path = _crafted(tmp_path, config=stored.to_dict(), mech={"impl": "scratch"})  # as an older checkpoint records it
    with pytest.raises(CheckpointError, match=r"resolves differently on this machine \(pass --amp-impl scratch"):
        resume_config({"resume": str(path)})
    assert resume_config({"resume": str(path), "amp_impl": "scratch"}).recipe.amp_impl == "scratch"


def test_a_refused_resume_builds_nothing(cli, saved, monkeypatch):
    built = []
    monkeypatch.setattr(build_mod, "load_data", lambda *a, **k: built.append("data"))
    monkeypatch.setattr(build_mod, "model_from_config", lambda *a, **k: built.append("model"))
    monkeypatch.setattr(build_mod.distributed, "setup", lambda *a, **k: built.append("process group"))
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("mmap")) or real_load(*a, **k))
    code, _, err = cli("train", "--resume", saved, "--lr", "1")
    assert code == 2 and "--lr 0.01 in the checkpoint vs 1.0 now" in err
    with pytest.raises(CheckpointError, match="--lr"):  # the Python API: build_run checks first
        build_run(TrainConfig.from_dict(real_load(saved / "last.pt", weights_only=True)["config"])
                  .with_flags(resume=str(saved), lr=1.0))
    assert built == [] and loads == [True, True]  # the stored config was read without reading tensors


def test_only_the_flags_typed_on_the_command_line_are_seen():
    parse = build_parser().parse_args
    assert typed_flags(parse(["train", "--resume", "r", "--epochs", "5"])) == {"resume": "r", "epochs": 5}
    assert typed_flags(parse(["train", "--epochs", "5", "--max-steps", "none"])) == {"epochs": 5, "max_steps": None}
    assert typed_flags(parse(["train", "--stochastic-rounding"])) == {"stochastic_rounding": True}
    doctor = typed_flags(parse(["doctor", "--epochs", "5"]))  # doctor (and bench) get every flag, defaults filled
    assert doctor["epochs"] == 5 and doctor["lr"] == TrainConfig().optim.lr and doctor["keep_fp32"] == ()


def test_help_shows_the_config_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    d = TrainConfig()
    for flag, value in [("--init-scale", f"{d.recipe.scaler.init_scale:g}"), ("--lr", f"{d.optim.lr:g}"),
                        ("--growth-interval", d.recipe.scaler.growth_interval), ("--model", d.model.name)]:
        assert f"(default {value})" in text.split(flag + " ", 2)[-1].split(" --")[0], flag


def test_resuming_a_complete_run_says_how_to_extend_it(cli, saved, monkeypatch):
    monkeypatch.chdir(saved.parent)
    before = (saved / "last.pt").read_bytes()
    code, out, err = cli("train", "--resume", "run")
    assert code == 0, err
    assert ("the run is already complete at step 3 (--epochs 2, --max-steps 3): pass a larger --epochs or "
            "--max-steps (none: no limit) to train further") in out
    assert (saved / "last.pt").read_bytes() == before


@pytest.mark.slow
def test_readme_resume_example_works_as_written(cli, tmp_path, monkeypatch):
    """README: `mixprec train --precision bf16-mixed --model mlp --epochs 5 --out runs/mlp --metrics-json
    runs/mlp.json`, then `mixprec train --resume runs/mlp --epochs 10` — bit-identical to 10 epochs straight."""
    monkeypatch.chdir(tmp_path)
    small = ["--dataset", "synthetic", "--synthetic-train", "256", "--synthetic-test", "64", "--width", "16",
             "--log-every", "0", "--progress", "off"]
    first = "train --precision bf16-mixed --model mlp --epochs 5 --out runs/mlp --metrics-json runs/mlp.json"
    code, _, err = cli(*first.split(), *small)
    assert code == 0, err
    code, out, err = cli(*"train --resume runs/mlp --epochs 10".split())
    assert code == 0, err
    assert "resumed from runs/mlp at epoch 5, batch 0" in out
    metrics = json.loads(Path("runs/mlp.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == list(range(10)) and metrics["summary"]["epochs"] == 10
    code, _, err = cli("train", "--precision", "bf16-mixed", "--model", "mlp", "--epochs", "10", "--out", "straight",
                       *small)
    assert code == 0, err
    a, b = (torch.load(Path(d) / "last.pt", weights_only=True)["model"] for d in ("runs/mlp", "straight"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_checkpoint_written_by_an_older_version_resumes(cli, saved, monkeypatch):
    """The fixture stopped at --max-steps 3 mid-epoch; `--max-steps none` lifts it and the epoch completes."""
    monkeypatch.chdir(saved.parent)  # the fixture's stored --out is the relative folder "run"
    code, out, err = cli("train", "--resume", "run", "--max-steps", "none", "--epochs", "1")
    assert code == 0, err
    assert "resumed from run at epoch 0, batch 3 (step 3)" in out
    ck = load_checkpoint(saved)
    steps = ck["global_step"]
    assert (ck["epoch"], ck["batch"]) == (1, 0) and steps > 3
    assert [h["steps"] for h in ck["history"]] == [steps]  # the interrupted epoch's record covers all its steps
    assert ck["config"]["recipe"]["precision"] == "bf16-mixed" and ck["config"]["optim"]["max_steps"] is None
    assert ck["mechanism"]["impl"] == "native"


# ------------------------------------------------------------------------------ a resume continues where it is


def test_a_resume_continues_in_the_folder_or_the_files_folder_it_resumes_from(saved):
    """The fixture stored --out run (as first typed); a resume of a copy, a moved folder or a file continues there."""
    assert resume_config({"resume": str(saved)}).run.out == str(saved)
    assert resume_config({"resume": str(saved / "last.pt")}).run.out == str(saved)
    assert resume_config({"resume": str(saved), "out": "elsewhere"}).run.out == "elsewhere"  # a flag typed now wins


@pytest.mark.parametrize("stored, typed, expected", [
    ("runA/metrics.json", {}, "{new}/metrics.json"),  # inside the old folder: follows the run
    ("runA/sub/m.json", {}, "{new}/sub/m.json"),
    ("runA.json", {}, "runA.json"),  # outside it: stays
    ("runA/metrics.json", {"metrics_json": "mine.json"}, "mine.json"),  # typed now: wins
    ("runA/metrics.json", {"out": "other"}, "other/metrics.json"),  # follows the --out typed now
])
def test_a_stored_metrics_json_inside_the_old_folder_follows_the_run(tmp_path, stored, typed, expected):
    config = TrainConfig.from_dict(torch.load(FIXTURE, weights_only=True)["config"])
    path = _crafted(tmp_path, config=config.with_flags(out="runA", metrics_json=stored).to_dict(), mech=None)
    resumed = resume_config({"resume": str(path), **typed})
    assert resumed.run.metrics_json == expected.format(new=path)


def test_a_checkpoint_file_beside_another_runs_last_pt_is_refused_naming_the_folder(cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE, run / "epoch1.pt")
    shutil.copy(FIXTURE, run / "last.pt")  # another file: continuing epoch1.pt here would replace it
    before = (run / "last.pt").read_bytes()
    code, out, err = cli("train", "--resume", run / "epoch1.pt")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"--resume {run / 'epoch1.pt'} continues in its folder {run}, which holds another checkpoint" in lines[0]
    assert "pass --out DIR to continue elsewhere, or --overwrite" in lines[0]
    assert (run / "last.pt").read_bytes() == before


def test_the_api_resume_continues_in_place(saved, monkeypatch):
    import mixprec.train.api as api

    seen = []

    def capture(config, **kw):
        seen.append(config)
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "build_run", capture)
    for kw in ({"resume": str(saved)}, {"resume": str(saved / "last.pt")}, {"resume": str(saved), "out": "x"}):
        with pytest.raises(KeyboardInterrupt):
            api.fit("mlp", "digits", **kw)
    assert [c.run.out for c in seen] == [str(saved), str(saved), "x"]


@pytest.mark.slow
def test_copied_moved_and_file_resumes_continue_in_place_bit_identical(cli, tmp_path, monkeypatch):
    """Train to runA and stop mid-epoch; a copy (runB), a copy resumed by its file (runD/last.pt) and runA itself
    moved (runC) each continue where they are — checkpoint, metrics (stored inside runA) and watch reports there;
    runA untouched, and not recreated once moved — and end bit-identical to the run that never stopped."""
    monkeypatch.chdir(tmp_path)
    tiny = ["--dataset", "digits", "--model", "mlp", "--width", "32", "--depth", "1", "--batch-size", "256",
            "--epochs", "2", "--momentum", "0.9", "--log-every", "0", "--progress", "off"]  # 6 steps an epoch
    assert cli("train", *tiny, "--out", "straight")[0] == 0
    code, _, err = cli("train", *tiny, "--max-steps", "5", "--out", "runA", "--metrics-json", "runA/metrics.json")
    assert code == 0, err
    saved = {p.name: p.read_bytes() for p in Path("runA").iterdir()}
    assert set(saved) == {"last.pt", "metrics.json"}
    ref = torch.load("straight/last.pt", weights_only=True)
    for resume, folder in (("runB", "runB"), ("runD/last.pt", "runD"), ("runC", "runC")):
        if folder == "runC":
            shutil.move("runA", "runC")
        else:
            shutil.copytree("runA", folder)
        code, out, err = cli("train", "--resume", resume, "--max-steps", "none", "--watch", "3")
        assert code == 0, err
        got = torch.load(Path(folder) / "last.pt", weights_only=True)
        assert got["global_step"] == ref["global_step"] == 12 and got["config"]["run"]["out"] == folder
        assert all(torch.equal(ref["model"][k], got["model"][k]) for k in ref["model"])
        for k, v in ref["optimizer"]["state"].items():
            assert all(torch.equal(v[n], got["optimizer"]["state"][k][n]) for n in v)
        assert [h["loss_curve"] for h in got["history"]] == [h["loss_curve"] for h in ref["history"]]
        metrics = json.loads((Path(folder) / "metrics.json").read_text())
        assert [e["epoch"] for e in metrics["epochs"]] == [0, 1] and metrics["config"]["run"]["out"] == folder
        assert (Path(folder) / "watch").is_dir()
        if folder != "runC":  # the original, as it was saved
            assert {p.name: p.read_bytes() for p in Path("runA").iterdir()} == saved
    assert not Path("runA").exists()  # the moved folder was not recreated
