"""A Hugging Face `transformers` model, built from a small config (random init, nothing downloaded).

    pip install -c <(echo torch==2.13.0) transformers     # pinned beside the CPU torch
    mixprec train --model examples/hf_transformer.py:make_gpt2 --dataset text --block-size 64 \\
        --precision bf16-mixed --optimizer adamw --lr 3e-3 --max-steps 200

The factory declares `vocab_size` and `block_size`, which mixprec takes from the text corpus and
`--block-size`. GPT-2's output is a `CausalLMOutput`; the wrapper returns its logits so the default
cross-entropy (over the last dimension) applies. fp8-mixed converts GPT-2's `Conv1D` projections too.
"""

from torch import nn


class LogitsOnly(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(input_ids=idx).logits


def make_gpt2(vocab_size, block_size):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                        eos_token_id=None)
    return LogitsOnly(GPT2LMHeadModel(config))


if __name__ == "__main__":
    from mixprec.train import fit

    result = fit(make_gpt2, "text", precision="bf16-mixed", block_size=64, optimizer="adamw", lr=3e-3,
                 max_steps=100, limit_test=200, log_every=20)
    print(result.summary)
