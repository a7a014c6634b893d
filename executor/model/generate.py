"""Text from a trained model, for a quick look at what it learned (`fastml generate`): the prompt's tokens in one
forward pass, then a token at a time, each layer's keys and values kept (a KV cache) so that a step costs one token's
work. Greedy (temperature 0) or sampled with a temperature and top-p (nucleus), from a seed.

It walks the blocks of a plain Transformer (transformer.py) itself, with the blocks' own modules: the training model's
forward pass, which recomputes and compiles, is not involved."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fastml.config import check_range, fail
from fastml.executor.model import fp8
from fastml.executor.model.transformer import Transformer, apply_rotary, rotary_tables


class KVCache:
    """Each block's keys and values so far, (1, positions, kv heads, head size), in room for `length` positions."""

    def __init__(self, model: Transformer, length: int, device: torch.device, dtype: torch.dtype):
        s = model.spec
        shape = (len(model.blocks), 2, 1, length, s.num_kv_heads, s.head_dim)
        self.tensors = torch.empty(shape, device=device, dtype=dtype)
        self.filled = 0

    def add(self, block: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores a step's k and v (1, T, Hkv, D) of `block` after those so far; returns all of them."""
        end = self.filled + k.shape[1]
        self.tensors[block, 0, :, self.filled:end] = k
        self.tensors[block, 1, :, self.filled:end] = v
        return self.tensors[block, 0, :, :end], self.tensors[block, 1, :, :end]


@torch.no_grad()
def next_logits(model: Transformer, tokens: torch.Tensor, cache: KVCache, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """The logits (vocab,) after `tokens` (1, T), which follow the cache's positions; the cache then holds them."""
    s, start = model.spec, cache.filled
    x = model.embed(tokens)
    c, n = cos[start:start + tokens.shape[1]], sin[start:start + tokens.shape[1]]
    for index, block in enumerate(model.blocks):
        a = block.attn
        q, k, v = a.qkv(block.attn_norm(x)).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q, k = q.unflatten(-1, (s.num_heads, s.head_dim)), k.unflatten(-1, (s.num_kv_heads, s.head_dim))
        v = v.unflatten(-1, (s.num_kv_heads, s.head_dim))
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        keys, values = cache.add(index, apply_rotary(k, c, n), v)
        # The prompt attends causally among itself; a later token, one at a time, to everything before it.
        out = F.scaled_dot_product_attention(apply_rotary(q, c, n).transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), is_causal=start == 0 and tokens.shape[1] > 1,
                                             enable_gqa=s.num_heads != s.num_kv_heads)
        x = x + a.out(out.transpose(1, 2).flatten(2))
        x = x + block.ffn(block.ffn_norm(x))
    cache.filled += tokens.shape[1]
    return F.linear(model.norm(x[:, -1]), model.lm_head_weight)[0].float()


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """The next token: the most likely at temperature 0, else drawn from the softmax at `temperature` over the
    smallest set of most likely tokens whose probabilities add up to `top_p`."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    kept = sorted_probs.cumsum(0) - sorted_probs < top_p  # each token whose predecessors fall short of top_p
    sorted_probs = sorted_probs * kept
    return int(order[torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)])


def generate(model: Transformer, prompt: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, eos_id: int | None = None, vocab_size: int | None = None) -> Iterator[int]:
    """The tokens that follow `prompt`, one at a time, up to `max_tokens` or the end-of-document token (not given);
    only ids below `vocab_size` (the tokenizer's, where the model's embedding is padded beyond it)."""
    check_range("--max-tokens", max_tokens, 1)
    check_range("--temperature", temperature, 0.0)
    check_range("--top-p", top_p, 0.0, 1.0, low_open=True)
    if not prompt:
        fail("--prompt", "has no tokens")
    parameter = next(model.parameters())
    length = len(prompt) + max_tokens
    cos, sin = rotary_tables(model.spec, length, parameter.device, parameter.dtype)
    cache = KVCache(model, length, parameter.device, parameter.dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    logits = next_logits(model, torch.tensor([prompt], device=parameter.device), cache, cos, sin)
    for made in range(1, max_tokens + 1):
        token = pick(logits[:vocab_size].cpu(), temperature, top_p, generator)
        if token == eos_id:
            return
        yield token
        if made < max_tokens:
            logits = next_logits(model, torch.tensor([[token]], device=parameter.device), cache, cos, sin)


SAMPLE_TOKENS = 64
"""Tokens each sample of a run (`fastml run --sample-every`) continues its prompt by."""


class Sampler:
    """`fastml run --sample-every N`: after every N steps, rank 0 continues `prompt` greedily with the weights as
    they are (the start of a document where it is empty), with the tokenizer the plan's data was prepared with.
    The weights must be whole on rank 0: a plan that streams or shards them samples nothing and says so once."""

    def __init__(self, plan, every: int, prompt: str = ""):
        from fastml.executor.storage.data import tokenizer_of_data
        from fastml.executor.storage.prepare import load_tokenizer

        check_range("--sample-every", every, 1)
        self.every, self.prompt_text = every, prompt
        self.tokenizer = load_tokenizer(tokenizer_of_data(plan.training.data))
        self.prompt = self.tokenizer.encode_batch([prompt])[0].tolist() if prompt else [self.tokenizer.eos_id]

    def due(self, steps_done: int) -> bool:
        return steps_done % self.every == 0

    def text(self, model: Transformer) -> str | None:
        """The prompt and its continuation; None where the model's weights are not all on this rank."""
        if model.placement.fetched or model.tp.active or model.pp.active:
            return None
        model.placement.finish_steps()  # the last step's CPU work, where it overlaps the next step, first ends
        fp8.refresh_weight_caches(model)  # the fp8 copies of the weights as the last optimizer step left them
        tokens = list(generate(model, self.prompt, SAMPLE_TOKENS, eos_id=self.tokenizer.eos_id,
                               vocab_size=self.tokenizer.vocab_size))
        return self.prompt_text + self.tokenizer.decode(tokens)
