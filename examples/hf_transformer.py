"""A Hugging Face `transformers` model, built from a small config (random init, nothing downloaded).

    pip install -c <(echo torch==2.13.0) transformers     # pinned beside the CPU torch
    mixprec train --model examples/hf_transformer.py:make_gpt2 --dataset text --block-size 64 \\
        --precision bf16-mixed --optimizer adamw --lr 3e-3 --max-steps 200

The factory declares `vocab_size` and `block_size`, which mixprec takes from the text corpus and
`--block-size`, and returns the model as it is: mixprec reads the `.logits` of its `CausalLMOutput` (README,
"How mixprec calls your model"). GPT-2 shifts `labels=` inside forward while the corpus's targets are already
the next characters, so mixprec does not pass them and trains it with cross-entropy on the logits (the run
says so). fp8-mixed converts GPT-2's `Conv1D` projections too.
"""


def make_gpt2(vocab_size, block_size):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                        eos_token_id=None)
    return GPT2LMHeadModel(config)


if __name__ == "__main__":
    from mixprec.train import fit

    result = fit(make_gpt2, "text", precision="bf16-mixed", block_size=64, optimizer="adamw", lr=3e-3,
                 max_steps=100, limit_test=200, log_every=20)
    print(result.summary)
