import pytest
import torch
from torch import nn

from mixprec.errors import NonFiniteError, RecipeError, ScalerConfigError
from mixprec.precision import ALIASES, RECIPES, RecipeSpec, ScalerConfig, build_recipe, resolve_recipe


@pytest.mark.parametrize("alias,name", [("amp", "fp16-mixed"), ("16-mixed", "fp16-mixed"), ("fp16", "fp16-mixed"),
                                        ("bf16", "bf16-mixed"), ("32", "fp32"), ("32-true", "fp32"),
                                        ("FP32", "fp32"), ("bf16-true", "bf16-true")])
def test_aliases_resolve(alias, name):
    assert resolve_recipe(alias).name == name


def test_every_alias_points_to_a_recipe():
    assert set(ALIASES.values()) <= set(RECIPES)


def test_unknown_recipe_lists_valid_names():
    with pytest.raises(RecipeError) as e:
        resolve_recipe("fp64")
    msg = str(e.value)
    assert "fp64" in msg and all(n in msg for n in RECIPES) and "amp=fp16-mixed" in msg


@pytest.mark.parametrize("kw,flag", [(dict(init_scale=0), "--init-scale"), (dict(growth_factor=1.0), "--growth-factor"),
                                     (dict(backoff_factor=1.0), "--backoff-factor"),
                                     (dict(growth_interval=0), "--growth-interval")])
def test_bad_scaler_config_names_the_flag(kw, flag):
    with pytest.raises(ScalerConfigError, match=flag):
        build_recipe("amp", scaler=ScalerConfig(**kw))


def test_contradictions():
    with pytest.raises(RecipeError, match="--stochastic-rounding"):
        build_recipe("bf16-mixed", stochastic_rounding=True)
    with pytest.raises(RecipeError, match="--amp-impl"):
        build_recipe("bf16-mixed", amp_impl="native", keep_fp32=("head",))
    with pytest.raises(RecipeError, match="--amp-impl"):
        build_recipe("bf16-mixed", amp_impl="cuda")


@pytest.mark.parametrize("fast_fp16_matmuls", [True, False], ids=["avx512-fp16-cpu", "cpu-without-fast-fp16"])
def test_auto_impl_picks_emulated_scratch_for_fp16_on_any_cpu(fast_fp16_matmuls, monkeypatch):
    """Even a CPU with fast fp16 matmuls (AVX512-FP16) gets emulation: torch's CPU fp16 convolution backward is a
    slow path there; native fp16 stays available and its line says so."""
    from mixprec import hardware

    monkeypatch.setattr(hardware, "has_fast_fp16", lambda device: fast_fp16_matmuls)
    r = build_recipe("amp", device="cpu")
    assert r.impl == "scratch" and r.emulate
    assert "EMULATED" in r.describe() and r.hardware_facts().matmul_dtype == "fp32"
    assert build_recipe("bf16-mixed", device="cpu").impl == "native"
    native = build_recipe("amp", device="cpu", amp_impl="native")
    assert not native.emulate and "EMULATED" not in native.describe()
    if fast_fp16_matmuls:
        assert "fp16 convolution backward is a slow path" in native.describe()
    else:
        assert "WARNING" in native.describe()
    assert build_recipe("amp", device="cpu", amp_impl="scratch").emulate


def test_auto_impl_emulates_bf16_on_a_cpu_without_bf16_kernels(monkeypatch):
    """An AVX2-only CPU (oneDNN has no bf16 there; PyTorch's bf16 GEMM is a scalar fallback): auto emulates
    bf16 as it does fp16, native stays available and warns, FP8 recipes keep their own layers; a CPU with
    bf16 kernels keeps native."""
    from mixprec import hardware

    monkeypatch.setattr(hardware, "has_bf16_kernels", lambda device: False)
    monkeypatch.setattr(hardware, "has_fast_bf16", lambda device: False)
    r = build_recipe("bf16-mixed", device="cpu")
    assert r.impl == "scratch" and r.emulate and r.facts()["emulated"]
    assert "bf16 is EMULATED" in r.describe() and r.hardware_facts().matmul_dtype == "fp32"
    assert r.fsdp_policy().param_dtype is None  # emulation gathers fp32 carriers
    native = build_recipe("bf16-mixed", device="cpu", amp_impl="native")
    assert not native.emulate and "WARNING" in native.describe() and "scalar fallback" in native.describe()
    assert build_recipe("fp8-mixed", device="cpu").impl == "native"
    with pytest.raises(RecipeError, match="compile fp32 instead"):
        r.check_compile()
    monkeypatch.setattr(hardware, "has_bf16_kernels", lambda device: True)
    slow = build_recipe("bf16-mixed", device="cpu")
    assert slow.impl == "native" and "likely SLOWER than fp32" in slow.describe()  # AVX-512 without BF16
    assert not build_recipe("bf16-mixed", device="cpu", amp_impl="scratch").emulate


def test_the_bf16_kernels_answer_can_be_pinned(monkeypatch):
    """MIXPREC_CPU_BF16_KERNELS pins the CPU's answer (the suite pins 1); unset, oneDNN's own check decides."""
    from mixprec import hardware

    cpu = torch.device("cpu")
    monkeypatch.setenv(hardware.BF16_KERNELS_ENV, "0")
    assert not hardware.has_bf16_kernels(cpu) and build_recipe("bf16-mixed", device=cpu).impl == "scratch"
    monkeypatch.setenv(hardware.BF16_KERNELS_ENV, "1")
    assert hardware.has_bf16_kernels(cpu) and build_recipe("bf16-mixed", device=cpu).impl == "native"
    monkeypatch.delenv(hardware.BF16_KERNELS_ENV)
    assert hardware.has_bf16_kernels(cpu) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_a_bad_bf16_kernels_pin_is_one_line_naming_the_values(monkeypatch, cli):
    from mixprec import hardware

    monkeypatch.setenv(hardware.BF16_KERNELS_ENV, "yes")
    code, out, err = cli("train", "--precision", "bf16-mixed", "--dataset", "synthetic", "--epochs", "1",
                         "--device", "cpu")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "MIXPREC_CPU_BF16_KERNELS='yes'" in lines[0] and "set 1" in lines[0] and "or 0" in lines[0]


def test_auto_impl_is_native_where_fp16_steps_are_fast(monkeypatch):
    from mixprec import hardware

    monkeypatch.setattr(hardware, "has_fast_fp16_training", lambda device: True)
    r = build_recipe("amp", device="cpu")
    assert r.impl == "native" and not r.emulate
    assert not build_recipe("amp", device="cpu", amp_impl="scratch").emulate


class _Tagger(nn.Module):
    """An embedding-like linear, an LSTM and a head: the LSTM sits between two autocast-lowered layers."""

    def __init__(self, proj_size: int = 0):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.lstm = nn.LSTM(8, 6, batch_first=True, proj_size=proj_size)
        self.head = nn.Linear(proj_size or 6, 3)

    def forward(self, x):
        h, _ = self.lstm(self.inp(x))
        return self.head(h)


def test_native_autocast_runs_an_lstm_this_cpu_cannot_lower_in_fp32(monkeypatch):
    """Where oneDNN has no bf16 LSTM (an AVX2-only CPU; faked here so every CPU runs the test) torch.autocast's
    LSTM forward raises: the native mechanism runs that layer in fp32 (autocast off, its bf16 input cast up),
    exactly as an fp32 LSTM would, and only it: the layers around it stay bf16, the hooks and the autocast
    state are gone after the context, even when the forward raised, and the description says so."""
    from mixprec import hardware

    monkeypatch.setattr(hardware, "autocast_runs_lstm", lambda dtype: False)
    r = build_recipe("bf16-mixed", device="cpu", amp_impl="native")
    torch.manual_seed(0)
    model = r.convert_module(_Tagger())
    seen = {}
    model.lstm.register_forward_hook(lambda m, a, out: seen.update(lstm_in=a[0], lstm_out=out[0]))
    x = torch.randn(2, 5, 4)
    with r.autocast():
        logits = model(x)
    assert logits.dtype == torch.bfloat16 and seen["lstm_in"].dtype == seen["lstm_out"].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lowered = model.inp(x)  # the bf16 input torch.autocast hands the LSTM
    want, _ = model.lstm(lowered.float())  # outside any autocast: the fp32 LSTM
    assert torch.equal(seen["lstm_out"], want)
    logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert r.mechanism.fp32_lstms == ("lstm",) and "nn.LSTM lstm in fp32" in r.describe()
    assert "--amp-impl scratch runs them in bf16" in r.describe()
    assert len(model.lstm._forward_pre_hooks) == 0 and not torch.is_autocast_enabled("cpu")
    with pytest.raises(RuntimeError), r.autocast():
        model.lstm(torch.randn(2, 5, 7))  # the wrong width: raises inside the fp32 LSTM
    assert not torch.is_autocast_enabled("cpu") and len(model.lstm._forward_pre_hooks) == 0
    with r.autocast():
        assert torch.is_autocast_enabled("cpu") and model.inp(x).dtype == torch.bfloat16


def test_native_autocast_leaves_an_lstm_alone_where_it_runs(monkeypatch):
    """A CPU whose oneDNN has the LSTM kernel, a projected LSTM (PyTorch's own kernel on every CPU) and an
    LSTM with bf16 parameters (bf16-true: its bf16 input takes PyTorch's own kernel too) keep torch.autocast's
    own handling; so does the scratch engine (it lowers the LSTM itself)."""
    from mixprec import hardware

    monkeypatch.setattr(hardware, "autocast_runs_lstm", lambda dtype: True)
    r = build_recipe("bf16-mixed", device="cpu", amp_impl="native")
    r.convert_module(_Tagger())
    assert r.mechanism.fp32_lstms == () and "nn.LSTM" not in r.describe()
    monkeypatch.setattr(hardware, "autocast_runs_lstm", lambda dtype: False)
    r = build_recipe("bf16-mixed", device="cpu", amp_impl="native")
    r.convert_module(_Tagger(proj_size=3))
    assert r.mechanism.fp32_lstms == ()
    r = build_recipe("bf16-true", device="cpu", amp_impl="native")
    model = r.convert_module(_Tagger())
    assert r.mechanism.fp32_lstms == ()
    with r.autocast():
        assert model(torch.randn(2, 5, 4).bfloat16()).dtype == torch.bfloat16
    r = build_recipe("bf16-mixed", device="cpu", amp_impl="scratch")
    r.convert_module(_Tagger())
    assert "nn.LSTM" not in r.describe()


def test_the_lstm_probe_agrees_with_torch_autocast_on_a_real_lstm():
    """hardware.autocast_runs_lstm tries a 1-unit LSTM; a 2-layer batch-first one agrees on this CPU."""
    from mixprec import hardware

    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    for dtype in (torch.bfloat16, torch.float16):
        try:
            with torch.autocast("cpu", dtype=dtype):
                out, _ = lstm(torch.randn(4, 3, 8))
            out.float().sum().backward()
            ran = True
        except RuntimeError as e:
            assert "primitive descriptor" in str(e)
            ran = False
        assert ran == hardware.autocast_runs_lstm(dtype), dtype


# What each recipe's description must state, written out here (not read from the spec): the params a
# master-weight recipe rounds into, whether a loss scaler runs, whether the forward is autocast.
_STATES = {  # name: (autocast, loss scaler, params rounded to)
    "fp32": (False, False, None), "tf32": (False, False, None), "fp16-mixed": (True, True, None),
    "bf16-mixed": (True, False, None), "fp16-master": (True, True, "fp16"), "bf16-master": (True, False, "bf16"),
    "bf16-true": (True, False, None), "fp8-mixed": (True, False, None), "fp8-rowwise": (True, False, None),
    "mxfp8": (True, False, None), "mxfp4": (True, False, None), "nvfp4": (True, False, None),
}
_WORDS = {"native": ("torch.autocast", "torch.amp.GradScaler"), "scratch": ("mixprec autocast", "DynamicLossScaler")}


def test_the_description_table_covers_every_recipe():
    assert set(_STATES) == set(RECIPES)


@pytest.mark.parametrize("impl", ["native", "scratch"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_describe_states_the_mechanism_the_scaler_and_the_param_dtype(name, impl):
    autocast, scaled, rounded_to = _STATES[name]
    r = build_recipe(name, amp_impl=impl, device="cpu")
    d = r.describe()
    autocast_words, scaler_words = _WORDS[impl]
    assert d.startswith(f"{name} [{impl}]: ")
    assert (autocast_words in d) == autocast and ("no autocast" in d) == (not autocast)
    assert (scaler_words in d) == scaled
    # the scaler's defaults, as GradScaler has them
    assert ("loss scale starts at 65536, x2 after 2000 finite steps, x0.5 on overflow" in d) == scaled
    assert ("optimizer steps fp32 master copies" in d) == (rounded_to is not None)
    if rounded_to:
        assert f"params rounded to {rounded_to} after each step" in d
    low = name not in ("fp32", "tf32")
    assert (r.hardware_facts().note in d) == (low or name == "tf32")


def test_describe_states_the_scaler_settings_and_stochastic_rounding_asked_for():
    d = build_recipe("fp16-mixed", device="cpu", scaler=ScalerConfig(init_scale=1024.0, growth_interval=10,
                                                                     backoff_factor=0.25)).describe()
    assert "loss scale starts at 1024, x2 after 10 finite steps, x0.25 on overflow" in d
    assert "updates rounded stochastically into bf16 params" in build_recipe("bf16-true", stochastic_rounding=True,
                                                                          device="cpu").describe()
    assert "stochastically" not in build_recipe("bf16-true", device="cpu").describe()
    assert "params rounded to bf16 after each step stochastically" in build_recipe(
        "bf16-master", stochastic_rounding=True, device="cpu").describe()


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("impl", ["native", "scratch"])
def test_clip_happens_on_true_gradients_not_scaled_ones(impl):
    """SGD lr=1 with clip c: if clipping saw unscaled grads the update norm is exactly c; clipping scaled grads
    (then unscaling) would shrink it by the scale (2**8), and no clipping would leave it at the true norm."""
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    recipe = build_recipe("fp16-mixed", amp_impl=impl, scaler=ScalerConfig(init_scale=2.0**8), device="cpu")
    model = recipe.convert_module(_tiny())
    opt = recipe.build_optimizer(model, lambda p: torch.optim.SGD(p, lr=1.0))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with recipe.autocast():
        loss = nn.functional.cross_entropy(model(x), y) * 100.0  # true grad norm >> clip
    recipe.backward(loss)
    clip = 1e-2
    res = recipe.step(opt, clip)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert not res.skipped and res.grad_norm.item() > 10 * clip
    assert res.grad_norm.item() < 1e4  # the *true* norm is reported, not the scaled one
    torch.testing.assert_close((after - before).norm().item(), clip, rtol=1e-3, atol=0)


def test_recipe_without_scaler_raises_before_touching_params_on_nonfinite_loss():
    recipe = build_recipe("bf16-mixed", device="cpu")
    model = recipe.convert_module(_tiny())
    opt = recipe.build_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with recipe.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long)) * float("inf")
    with pytest.raises(NonFiniteError, match="step 7"):
        recipe.backward(loss, step=7)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


@pytest.mark.parametrize("impl", ["native", "scratch"])
def test_scaled_recipe_skips_inf_step_and_backs_off(impl):
    recipe = build_recipe("fp16-mixed", amp_impl=impl, scaler=ScalerConfig(init_scale=1024.0), device="cpu")
    model = recipe.convert_module(_tiny())
    opt = recipe.build_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with recipe.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long))
    recipe.backward(loss * float("inf"))
    res = recipe.step(opt)
    assert res.skipped and recipe.loss_scale() == 512.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_run_context_restores_matmul_precision():
    before = torch.get_float32_matmul_precision()
    r = build_recipe("tf32")
    with pytest.raises(KeyError):
        with r.run_context():
            # TF32 only exists on CUDA tensor cores; on CPU the recipe runs as fp32
            assert torch.get_float32_matmul_precision() == ("high" if r.device.type == "cuda" else "highest")
            raise KeyError("boom")
    assert torch.get_float32_matmul_precision() == before


# -- the recipe table refuses what cannot train --------------------------------------------------------------

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize("spec,words", [
    (dict(name="fp16-true", compute_dtype=F16, param_dtype=F16, autocast=True, loss_scaling=True,
          master_weights=False), "fp16 params with loss scaling but no fp32 master"),
    (dict(name="fp8-plain", compute_dtype=BF16, param_dtype=F32, autocast=False, loss_scaling=False,
          master_weights=False, fp8="tensorwise"), "fp8 without autocast"),
    (dict(name="fp32-master", compute_dtype=F32, param_dtype=F32, autocast=False, loss_scaling=False,
          master_weights=True), "master_weights with fp32 params"),
    (dict(name="bf16-scaled", compute_dtype=BF16, param_dtype=F32, autocast=True, loss_scaling=True,
          master_weights=False), "loss scaling with bf16 compute"),
    (dict(name="fp32-scaled", compute_dtype=F32, param_dtype=F32, autocast=False, loss_scaling=True,
          master_weights=False), "loss scaling with fp32 compute"),
    (dict(name="tf32-bf16", compute_dtype=BF16, param_dtype=F32, autocast=True, loss_scaling=False,
          master_weights=False, tf32=True), "tf32 with bf16 compute"),
    (dict(name="fp8-fp16", compute_dtype=F16, param_dtype=F32, autocast=True, loss_scaling=True,
          master_weights=False, fp8="tensorwise"), "fp8 with fp16 compute"),
    (dict(name="fp32-autocast", compute_dtype=F32, param_dtype=F32, autocast=True, loss_scaling=False,
          master_weights=False), "autocast with fp32 compute"),
    (dict(name="bf16-no-autocast", compute_dtype=BF16, param_dtype=F32, autocast=False, loss_scaling=False,
          master_weights=False), "bf16 compute without autocast"),
    (dict(name="mixed-halves", compute_dtype=F16, param_dtype=BF16, autocast=True, loss_scaling=True,
          master_weights=True), "bf16 params with fp16 compute"),
    (dict(name="fp64", compute_dtype=torch.float64, param_dtype=F32, autocast=True, loss_scaling=False,
          master_weights=False), "compute_dtype=torch.float64 is not one of fp32, fp16, bf16"),
])
def test_an_impossible_recipe_spec_is_refused_when_built(spec, words):
    with pytest.raises(RecipeError) as e:
        RecipeSpec(**spec, summary="a recipe that cannot train")
    msg = str(e.value)
    assert msg.startswith(f"RecipeSpec(name={spec['name']!r}): ") and words in msg, msg


def test_a_spec_needs_a_summary():
    with pytest.raises(RecipeError, match="summary is empty"):
        RecipeSpec(name="x", compute_dtype=BF16, param_dtype=F32, autocast=True, loss_scaling=False,
                   master_weights=False, summary="")


def test_why_fp16_params_need_a_master_to_be_loss_scaled():
    """The rule above in PyTorch's own words: GradScaler does not unscale fp16 gradients (mixprec's scaler
    would, which is how an fp16-true spec trained under scratch and crashed under native)."""
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((p.float() * 2).sum()).backward()
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(opt)


# -- mechanisms are classes: a new one is registered, not branched on ----------------------------------------

def test_a_new_mechanism_is_one_registered_class(monkeypatch):
    from mixprec.mechanisms import MECHANISMS, NativeMechanism

    entered = []

    class Recording(NativeMechanism):
        name = "recording"
        autocast_words = "recording autocast"

        def autocast(self, model):
            entered.append(model)
            return super().autocast(model)

    monkeypatch.setitem(MECHANISMS, "recording", Recording)
    r = build_recipe("bf16-mixed", amp_impl="recording", device="cpu")
    assert r.impl == "recording" and r.label == "bf16-mixed [recording]" and isinstance(r.mechanism, Recording)
    assert "recording autocast" in r.describe()
    model = r.convert_module(_tiny())
    opt = r.build_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    with r.autocast():
        out = model(torch.randn(4, 8))
    assert out.dtype == torch.bfloat16 and entered == [model]
    r.backward(out.float().sum())
    assert not r.step(opt).skipped


def test_an_unknown_mechanism_lists_the_registered_ones():
    with pytest.raises(RecipeError) as e:
        build_recipe("bf16-mixed", amp_impl="apex")
    assert "'apex'" in str(e.value) and "auto, native, scratch" in str(e.value)


def test_a_recipe_to_run_on_a_device_this_machine_lacks_is_refused_and_a_target_is_not(cli):
    """``build_recipe`` refuses a device that is not here, as ``--device`` does (the GPU index one past the
    last refuses on any machine: ``cuda:0`` without CUDA, ``cuda:1`` on one GPU); planning for it is
    ``for_target=True``, whose recipe answers the device-free questions (what runs in which dtype)."""
    absent = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(RecipeError) as e:
        build_recipe("fp32", device=absent)
    msg = str(e.value)
    assert msg.startswith(f"build_recipe('fp32', device='{absent}'): ") and "for_target=True" in msg
    assert ("no CUDA device is available" in msg) if not torch.cuda.is_available() else (f"no {absent}" in msg)
    if not torch.cuda.is_available():  # the case, word for word
        with pytest.raises(RecipeError, match="no CUDA device is available"):
            build_recipe("fp32", device="cuda")
    code, _, err = cli("train", "--device", absent, "--dataset", "digits", "--epochs", "1")
    assert code == 2 and f"--device {absent} was requested but" in err and "Traceback" not in err

    target = build_recipe("fp16-mixed", device=absent, for_target=True)
    assert target.device == torch.device(absent) and target.impl == "native"  # a GPU has fast fp16: native
    assert target.facts() == {"compute": "fp16", "params": "fp32", "loss_scaling": True, "master_weights": False,
                              "emulated": False, "stochastic_rounding": False, "fp8_impl": None}
    assert build_recipe("bf16-master", device=absent, for_target=True).facts()["master_weights"] is True
    assert build_recipe("fp32", device="cpu").device == torch.device("cpu")  # here: no flag needed


@pytest.mark.parametrize("name", ["bf16-mixed", "fp16-mixed", "tf32", "fp8-mixed", "nvfp4"])
def test_the_hardware_is_asked_once_when_a_recipe_is_built(monkeypatch, name):
    """Decide once, pass down: build_recipe asks each capability once (hardware.capabilities); what the recipe,
    its mechanism and its FP8/FP4 implementation say afterwards reads that answer."""
    from mixprec import hardware

    calls: dict[str, int] = {}
    for fn in ("has_tf32", "has_fast_bf16", "has_bf16_kernels", "has_fast_fp16", "has_fast_fp16_training",
               "has_fp8_matmul", "has_lowp_units", "has_mx_matmul", "describe_device"):
        real = getattr(hardware, fn)

        def counted(*a, _fn=fn, _real=real, **k):
            calls[_fn] = calls.get(_fn, 0) + 1
            return _real(*a, **k)

        monkeypatch.setattr(hardware, fn, counted)
    recipe = build_recipe(name, device="cpu")
    asked = dict(calls)
    recipe.describe(), recipe.hardware_facts(), recipe.facts(), recipe.compiles("auto")
    with recipe.run_context():
        pass
    if recipe.fp8 is not None:
        recipe.fp8.real()
    assert calls == asked and all(n <= 2 for n in asked.values()), calls  # rowwise units ask fp8 once more
