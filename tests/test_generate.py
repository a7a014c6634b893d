"""`fastml generate` (executor/model/generate.py): greedy tokens of a model converted from HF equal transformers'
`generate` for every supported family, the KV cache's logits equal a full forward pass's, sampling follows its seed,
and the command continues a prompt with the tokenizer the checkpoint's data was prepared with.

Greedy tokens agree between two implementations only where the two largest logits are further apart than their
rounding: the test measures how far the two models' fp32 logits of the generated sequence differ, and checks that
every step's top two are ten times further apart, so that the tokens' equality does not hang on one CPU's rounding."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fastml.executor.model.generate import KVCache, generate, next_logits
from fastml.executor.model.transformer import rotary_tables
from fastml.executor.storage.checkpoints import load_for_inference
from fastml.executor.storage.hf import convert_from_hf
from test_hf import FAMILIES, VOCAB, hf_model

transformers = pytest.importorskip("transformers")

PROMPT, NEW = [5, 17, 99, 3, 42, 8], 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
    """(HF model, our model from its fastml checkpoint) of one family."""
    root = tmp_path_factory.mktemp(request.param)
    hf = hf_model(request.param)
    hf.save_pretrained(root / "hf")
    convert_from_hf(root / "hf", root / "ckpt")
    return hf, load_for_inference(root / "ckpt", torch.device("cpu"), torch.float32)


def test_greedy_tokens_equal_transformers_generate(converted):
    hf, ours = converted
    tokens = list(generate(ours, PROMPT, NEW))
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
        differ = (ours.logits(torch.tensor([PROMPT + tokens]))[0, len(PROMPT) - 1:-1] - logits).abs().max().item()
    top2 = logits.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 10 * max(differ, 1e-6)  # no step's choice hangs on the rounding
    assert tokens == expected[0, len(PROMPT):].tolist()


def test_the_kv_cache_gives_a_full_forward_passs_logits(converted):
    _, ours = converted
    sequence = PROMPT + [7, 64, 1, 90]
    cos, sin = rotary_tables(ours.spec, len(sequence), torch.device("cpu"), torch.float32)
    cache = KVCache(ours, len(sequence), torch.device("cpu"), torch.float32)
    stepped = [next_logits(ours, torch.tensor([PROMPT]), cache, cos, sin)]
    stepped += [next_logits(ours, torch.tensor([[t]]), cache, cos, sin) for t in sequence[len(PROMPT):-1]]
    with torch.no_grad():
        full = ours.logits(torch.tensor([sequence[:-1]]))[0, len(PROMPT) - 1:]
    assert torch.allclose(torch.stack(stepped), full, atol=1e-5, rtol=1e-5)


def test_sampling_follows_its_seed_and_top_p_one_token_is_greedy(converted):
    _, ours = converted
    first = list(generate(ours, PROMPT, NEW, temperature=1.0, seed=3))
    assert first == list(generate(ours, PROMPT, NEW, temperature=1.0, seed=3))
    assert first != list(generate(ours, PROMPT, NEW, temperature=1.0, seed=4))
    assert all(0 <= t < VOCAB for t in first)
    # A nucleus smaller than any one token's probability keeps the most likely token alone.
    assert list(generate(ours, PROMPT, NEW, temperature=1.0, top_p=1e-6, seed=3)) == list(generate(ours, PROMPT, NEW))


def test_the_command_continues_a_prompt_with_the_checkpoints_tokenizer(tmp_path):
    """A tiny run on the default corpus (bytes), checkpointed; `fastml generate` then needs no --tokenizer."""
    from fastml.executor.loop.train import train
    from fastml.plan import Hardware, Knobs, Plan, Training
    from small_model import SMALL

    plan = Plan(model=SMALL, training=Training(seq_len=32, global_batch_tokens=64, steps=2,
                                               checkpoint_dir=str(tmp_path / "ck")),
                hardware=Hardware(device="cpu"), knobs=Knobs(micro_batch_size=2, param_dtype="fp32",
                                                             matmul_dtype="fp32"))
    train(plan, show_progress=False)
    done = subprocess.run([sys.executable, "-m", "fastml", "generate", str(tmp_path / "ck" / "step-00000002"),
                           "--prompt", "def main(", "--max-tokens", "8"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def main(") and len(done.stdout.rstrip("\n")) > len("def main(")


def test_a_run_samples_what_generate_gives_its_checkpoint(tmp_path, capsys):
    """`--sample-every`: the run's sample after step 2 is the greedy continuation `generate` gives the step-2
    checkpoint's weights (the same function on the same fp32 weights)."""
    from fastml.executor.loop.train import train
    from fastml.executor.model.generate import SAMPLE_TOKENS
    from fastml.executor.storage.prepare import ByteTokenizer
    from fastml.plan import Hardware, Knobs, Plan, Training
    from small_model import SMALL

    plan = Plan(model=SMALL, training=Training(seq_len=32, global_batch_tokens=64, steps=2,
                                               checkpoint_dir=str(tmp_path / "ck")),
                hardware=Hardware(device="cpu"), knobs=Knobs(micro_batch_size=2, param_dtype="fp32",
                                                             matmul_dtype="fp32"))
    train(plan, show_progress=False, sample_every=2, sample_prompt="def ")
    said = " ".join(capsys.readouterr().out.split())
    model = load_for_inference(tmp_path / "ck" / "step-00000002", torch.device("cpu"), torch.float32)
    tokens = list(generate(model, list(b"def "), SAMPLE_TOKENS, eos_id=ByteTokenizer.eos_id,
                           vocab_size=ByteTokenizer.vocab_size))
    expected = " ".join(repr("def " + ByteTokenizer().decode(tokens)).split())
    assert f"sample after step 2: {expected}" in said
