import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.autocast import autocast as mixprec_autocast
from mixprec.errors import UsageError
from mixprec.lowp.convert import plan_fp8_conversion
from mixprec.train.gpt import GPT, lm_loss
from mixprec.train.models import ModelError
from mixprec.train.data import TextWindowLoader, load_text_corpus


def tiny(vocab=11, block=8, **kw):
    torch.manual_seed(0)
    sizes = dict(n_layers=2, n_heads=2, d_model=16) | kw
    return GPT(vocab, block, **sizes)


def sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.double() - want.double()).pow(2).sum()
    return 10 * math.log10(want.double().pow(2).sum() / noise)


def test_shapes_full_and_shorter_sequences():
    model = tiny(vocab=11, block=8)
    idx = torch.randint(0, 11, (3, 8))
    assert model(idx).shape == (3, 8, 11)
    assert model(idx[:, :5]).shape == (3, 5, 11)
    assert model(idx).dtype == torch.float32


def test_causal_logits_before_t_do_not_depend_on_token_t(one_thread):
    model = tiny(vocab=11, block=8).eval()
    idx = torch.randint(0, 11, (2, 8))
    for t in (0, 3, 7):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 11
        with torch.no_grad():
            a, b = model(idx), model(changed)
        torch.testing.assert_close(b[:, :t], a[:, :t], rtol=0, atol=0)
        assert (b[:, t] - a[:, t]).abs().max() > 1e-4  # token t itself does matter (the test is not vacuous)


def test_head_is_tied_to_token_embedding_even_after_dtype_conversion():
    model = tiny(vocab=11, d_model=16)
    assert model.head.weight is model.wte.weight
    # one Parameter counted once: embeddings (11 + 8) x 16, per block 2 LN (64) + qkv (16*48 + 48)
    # + proj (16*16 + 16) + up (16*64 + 64) + down (64*16 + 16), final LN 32, no separate head
    per_block = 64 + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16)
    assert sum(p.numel() for p in model.parameters()) == 19 * 16 + 2 * per_block + 32
    model = model.to(torch.bfloat16)
    assert model.head.weight is model.wte.weight
    assert model.head.weight.dtype == torch.bfloat16


def test_nanogpt_init_and_loss_at_init_is_ln_vocab():
    torch.manual_seed(0)
    model = GPT(65, 32, n_layers=8, n_heads=4, d_model=64)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.1)
        assert block.mlp.down.weight.std().item() == pytest.approx(residual, rel=0.1)
        assert block.attn.qkv.bias.abs().max() == 0
    idx = torch.randint(0, 65, (4, 32))
    with torch.no_grad():
        loss = lm_loss(model(idx), torch.randint(0, 65, (4, 32)))
    assert abs(loss.item() - math.log(65)) < 0.1


def test_lm_loss_is_fp32_cross_entropy_over_flattened_tokens():
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))
    want = F.cross_entropy(logits.reshape(15, 7), targets.reshape(15))
    torch.testing.assert_close(lm_loss(logits, targets), want, rtol=0, atol=0)
    low = logits.bfloat16()
    got = lm_loss(low, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.cross_entropy(low.float().reshape(15, 7), targets.reshape(15)), rtol=0, atol=0)
    with pytest.raises(ModelError, match=r"logits \(B, T, V\) and targets \(B, T\)"):
        lm_loss(logits, targets[:, :4])


def test_tiny_gpt_overfits_a_tiny_text(tmp_path, one_thread):
    path = tmp_path / "tiny.txt"
    path.write_text("the quick brown fox jumps over the lazy dog.\n" * 20)
    corpus = load_text_corpus(str(path), block_size=16)
    loader = TextWindowLoader(corpus.train, 16, 16, seed=0, steps_per_epoch=50)
    torch.manual_seed(0)
    model = GPT(corpus.vocab_size, 16, n_layers=2, n_heads=2, d_model=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in loader:
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.9 * math.log(corpus.vocab_size)
    assert sum(losses[-5:]) / 5 < 0.5  # a 45-character cycle: the model learns to recite it
    with torch.no_grad():
        test = lm_loss(model(corpus.x_test), corpus.y_test).item()
    assert test < 0.5  # the test split is more of the same cycle


def test_bf16_autocast_forward_is_close_to_fp32(one_thread):
    model = tiny(vocab=50, block=16, d_model=32)
    idx = torch.randint(0, 50, (4, 16))
    targets = torch.randint(0, 50, (4, 16))
    with torch.no_grad():
        want = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(idx)
            loss = lm_loss(got, targets)
    assert got.dtype == torch.bfloat16  # the head ran in bf16 ...
    assert loss.dtype == torch.float32  # ... the loss did not
    assert sqnr_db(got, want) > 30  # bf16 keeps 8 bits: ~48 dB per rounding, a few roundings deep
    assert loss.item() == pytest.approx(lm_loss(want, targets).item(), rel=1e-2)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mixprec_autocast_matches_torch_autocast_exactly(low, one_thread):
    idx, targets = torch.randint(0, 11, (2, 8)), torch.randint(0, 11, (2, 8))

    def step(ctx):
        model = tiny(vocab=11, block=8)
        with ctx:
            loss = lm_loss(model(idx), targets)
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    want_loss, want_grads = step(torch.autocast("cpu", dtype=low))
    got_loss, got_grads = step(mixprec_autocast(low, device_type="cpu"))
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fp8_converts_every_block_linear_and_keeps_the_tied_head_out():
    model = tiny(vocab=64, d_model=32)  # vocab a multiple of 16 too: the head is kept out by its name
    plan = plan_fp8_conversion(model)
    assert set(plan.converted) == {f"blocks.{i}.{name}" for i in range(2)
                                   for name in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")}
    assert [fqn for fqn, _ in plan.skipped] == ["head"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=30, n_heads=4), r"--d-model 30 must be divisible by --n-heads 4.*--n-heads 2"),
        (dict(d_model=0), r"--d-model 0 must be a positive integer"),
        (dict(n_layers=-1), r"--n-layers -1 must be a positive integer"),
        (dict(n_heads=True), r"--n-heads True must be a positive integer"),
        (dict(vocab=0), r"--vocab-size 0 must be a positive integer"),
        (dict(block=2.0), r"--block-size 2.0 must be a positive integer"),
        (dict(dropout=1.0), r"--dropout 1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_sizes_raise_usage_errors(kwargs, match):
    vocab, block = kwargs.pop("vocab", 11), kwargs.pop("block", 8)
    sizes = dict(n_layers=1, n_heads=2, d_model=16) | kwargs
    with pytest.raises(ModelError, match=match) as info:
        GPT(vocab, block, **sizes)
    assert isinstance(info.value, UsageError)


def test_sequence_longer_than_block_size_says_both_lengths():
    model = tiny(block=8)
    with pytest.raises(UsageError, match=r"sequence length 9 is longer than block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(UsageError, match=r"shape \(batch, time\), got shape \(8,\)"):
        model(torch.zeros(8, dtype=torch.long))


def test_dropout_is_active_in_training_only():
    model = tiny(dropout=0.5)
    idx = torch.randint(0, 11, (2, 8))
    model.train()
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    torch.testing.assert_close(model(idx), model(idx), rtol=0, atol=0)
