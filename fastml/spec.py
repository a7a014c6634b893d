"""Model facts: the architecture of a Llama-family transformer, presets, HF config.json import, and counts.

These are facts about the model, not searchable choices; the planner's costs and the executor's model both
derive from `ModelSpec`, and a test checks that `num_params` equals the executor model's real count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastml.config import UserError, as_type, check_range, fail, read_json, show

# Upper bounds far above any real model (the largest presets have 80 layers, hidden 8192, vocab 152064): an absurd
# spec is refused before it can hang a planner loop or exhaust memory.
MAX_SIZES = {"num_layers": 1024, "hidden_size": 2**17, "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024,
             "ffn_hidden_size": 2**20, "vocab_size": 2**24}
MAX_ROPE_THETA = 1e12
MAX_SEQ_LEN = 2**20


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3 frequency scaling of RoPE (HF `rope_scaling` with `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    def __post_init__(self) -> None:
        check_range("model.rope_scaling.factor", self.factor, 1.0)
        check_range("model.rope_scaling.low_freq_factor", self.low_freq_factor, 0.0, low_open=True)
        # The blend between the two divides by their difference.
        check_range("model.rope_scaling.high_freq_factor", self.high_freq_factor, self.low_freq_factor,
                    low_open=True)
        check_range("model.rope_scaling.original_max_seq_len", self.original_max_seq_len, 1, MAX_SEQ_LEN)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    """A preset name, or the HF directory the numbers were read from."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name, high in MAX_SIZES.items():
            check_range(f"model.{name}", getattr(self, name), 1, high)
        check_range("model.norm_eps", self.norm_eps, 0.0, 1.0)
        check_range("model.rope_theta", self.rope_theta, 1.0, MAX_ROPE_THETA)
        if self.num_heads % self.num_kv_heads:
            fail("model.num_kv_heads", f"{self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            fail("model.head_dim", f"{self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def block_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of one block's linear layers, by the executor's module name (attn.qkv,
        attn.out, ffn.gate_up, ffn.down): q, k and v are one matmul, and so are gate and up."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return {"qkv": (self.q_size + 2 * self.kv_size, h), "out": (h, self.q_size), "gate_up": (2 * f, h),
                "down": (h, f)}

    def lm_head_shape(self) -> tuple[int, int]:
        """(out_features, in_features) of the LM head (the embedding matrix itself when tied)."""
        return self.vocab_size, self.hidden_size

    def layer_matmul_params(self) -> int:
        """Weights of one block's matmuls."""
        return sum(n * k for n, k in self.block_linear_shapes().values())

    def attention_forward_flops_per_token(self, seq_len: int) -> float:
        """FLOPs of one block's causal attention forward, per token of a sequence of `seq_len`: q·kᵀ and p·v are
        each 2·seq_len·head_dim per head and token over the full square, halved because the causal mask leaves
        out the upper triangle (flash attention skips those tiles)."""
        return 2.0 * seq_len * self.q_size

    def elementwise_elements_per_token(self, compiled: bool) -> float:
        """Elements read and written per token by one block's forward pass outside its matmuls and attention: norms,
        rotary embedding, SwiGLU, residual adds and the head-merging copy. Compilation fuses chains of them into single
        passes; SwiGLU is one fused op either way (executor/model/fused.py: reads gate and up, writes the product)."""
        h, qk, q, f = self.hidden_size, self.q_size + self.kv_size, self.q_size, self.ffn_hidden_size
        if compiled:
            return 4 * h + 2 * qk + 2 * q + 3 * f
        return 10 * h + 8 * qk + 2 * q + 3 * f

    def layer_params(self) -> int:
        bias = self.q_size + 2 * self.kv_size if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return self.layer_matmul_params() + bias + qk_norm + 2 * self.hidden_size

    def num_params(self) -> int:
        """Every parameter of the executor's model; a tied LM head shares the embedding and counts once."""
        embedding = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tied_embeddings else embedding
        return embedding + self.num_layers * self.layer_params() + self.hidden_size + lm_head

    def num_matmul_params(self) -> int:
        """N_matmul of DESIGN.md: all matmul weights including the LM head, excluding the input embedding."""
        vocab, hidden = self.lm_head_shape()
        return self.num_layers * self.layer_matmul_params() + vocab * hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token: 6·N_matmul + 6·L·h·s (PaLM, Chowdhery et al. 2022, appendix B,
        halved attention term for causal masking; DESIGN.md "Definitions"). Recompute is not counted."""
        return 6.0 * self.num_matmul_params() + 3 * self.num_layers * self.attention_forward_flops_per_token(seq_len)


def _spec(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, **extra) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                     head_dim=extra.pop("head_dim", hidden // heads), ffn_hidden_size=ffn, vocab_size=vocab, **extra)


_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_LLAMA3 = dict(rope_theta=500000.0, norm_eps=1e-5)
_QWEN = dict(rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True)
_QWEN_LARGE = dict(_QWEN, norm_eps=1e-5)

# Numbers from each model's HF config.json. `tiny` is ours: a few million parameters for CPU runs and tests.
PRESETS: dict[str, ModelSpec] = {s.name: s for s in [
    _spec("tiny", 4, 256, 4, 2, 704, 512),
    _spec("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000),
    _spec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    _spec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
    _spec("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, tied_embeddings=True, rope_scaling=_LLAMA32_ROPE,
          **_LLAMA3),
    _spec("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128256, tied_embeddings=True, rope_scaling=_LLAMA32_ROPE,
          **_LLAMA3),
    _spec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, rope_scaling=_LLAMA31_ROPE, **_LLAMA3),
    _spec("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, rope_scaling=_LLAMA31_ROPE, **_LLAMA3),
    _spec("mistral-7b", 32, 4096, 32, 8, 14336, 32768, rope_theta=1000000.0),
    _spec("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tied_embeddings=True, **_QWEN),
    _spec("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, tied_embeddings=True, **_QWEN),
    _spec("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, tied_embeddings=True, **_QWEN),
    _spec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, **_QWEN),
    _spec("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, **_QWEN_LARGE),
    _spec("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, **_QWEN_LARGE),
    _spec("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, **_QWEN_LARGE),
    _spec("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, head_dim=128, rope_theta=1000000.0, norm_eps=1e-6,
          qk_norm=True),
]}

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, or a directory (or config.json file) of an HF Llama, Mistral, Qwen2 or Qwen3 model."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return spec_from_hf_config(read_json(path, "an HF config.json"), name=str(path.parent), where=str(path))
    fail("model", f"{show(name_or_path)} is neither a preset ({', '.join(PRESETS)}) nor a directory with a "
                  "config.json")


def spec_from_hf_config(config: dict, name: str, where: str | None = None) -> ModelSpec:
    """The spec of an HF config.json's contents; `where` names the file in errors (default: NAME/config.json)."""
    where = where or f"{name}/config.json"
    if not isinstance(config, dict):
        fail(where, f"expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in HF_ARCHITECTURES:
        fail(where, f"model_type {show(model_type)} is not supported; supported: {', '.join(HF_ARCHITECTURES)}")
    _check_supported_hf(config, model_type, where)
    heads = _hf_value(config, "num_attention_heads", int, where)
    hidden = _hf_value(config, "hidden_size", int, where)
    check_range(f"{where}: num_attention_heads", heads, 1)
    rope = _rope_parameters(config, where)
    scaling = _rope_scaling(rope, where)
    values = dict(
        num_layers=_hf_value(config, "num_hidden_layers", int, where), hidden_size=hidden, num_heads=heads,
        num_kv_heads=_hf_value(config, "num_key_value_heads", int, where, None) or heads,
        head_dim=_hf_value(config, "head_dim", int, where, None) or hidden // heads,
        ffn_hidden_size=_hf_value(config, "intermediate_size", int, where),
        vocab_size=_hf_value(config, "vocab_size", int, where),
        rope_theta=_hf_value(rope, "rope_theta", float, where, 10000.0),
        norm_eps=_hf_value(config, "rms_norm_eps", float, where, 1e-6),
        tied_embeddings=_hf_value(config, "tie_word_embeddings", bool, where, False))
    try:
        return ModelSpec(name=name, rope_scaling=scaling and RopeScaling(**scaling), qkv_bias=model_type == "qwen2",
                         qk_norm=model_type == "qwen3", **values)
    except UserError as e:  # a value out of range: name the file it came from
        raise UserError(f"{where}: {e}") from None


_REQUIRED = object()


def _hf_value(config: dict, key: str, hint: type, where: str, default: Any = _REQUIRED) -> Any:
    """config[key] checked as `hint`; `default` when the key is missing or null (HF writes null for "unset")."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            fail(where, f"missing key {key!r}")
        return default
    return as_type(hint, value, f"{where}: {key}")


def _check_supported_hf(config: dict, model_type: str, where: str) -> None:
    """Refuses what our model does not compute, rather than loading it and computing something else."""
    if config.get("sliding_window") and config.get("use_sliding_window", model_type == "mistral"):
        fail(where, "sliding-window attention is not supported")
    if config.get("hidden_act", "silu") != "silu":
        fail(where, f"hidden_act {show(config['hidden_act'])} is not supported; only 'silu' (SwiGLU)")
    if config.get("mlp_bias"):
        fail(where, "mlp_bias is not supported")
    # In Llama, Mistral and Qwen3, attention_bias also puts a bias on the output projection, which our model lacks.
    if config.get("attention_bias") and model_type != "qwen2":
        fail(where, f"attention_bias is not supported for model_type {model_type!r}")


def hf_config(spec: ModelSpec, max_seq_len: int = 8192, dtype: str = "bfloat16") -> dict:
    """The HF config.json that describes `spec`, for export. Qwen2 is the family with qkv bias, Qwen3 with qk-norm."""
    if spec.qk_norm and spec.qkv_bias:
        fail("model", "no supported HF family has both qk-norm and a qkv bias, so this model cannot be exported")
    model_type = "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias else "llama"
    rope_parameters = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling:
        s = spec.rope_scaling
        rope_parameters.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                               high_freq_factor=s.high_freq_factor,
                               original_max_position_embeddings=s.original_max_seq_len)
    config = {
        "architectures": [HF_ARCHITECTURES[model_type]], "model_type": model_type,
        "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn_hidden_size, "vocab_size": spec.vocab_size, "hidden_act": "silu",
        "rms_norm_eps": spec.norm_eps, "tie_word_embeddings": spec.tied_embeddings,
        "rope_theta": spec.rope_theta, "rope_scaling": rope_parameters if spec.rope_scaling else None,
        "rope_parameters": rope_parameters, "max_position_embeddings": max_seq_len, "dtype": dtype,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config


def _rope_parameters(config: dict, where: str) -> dict:
    # transformers >= 5 writes `rope_parameters`; older configs have `rope_theta` and `rope_scaling` at the top.
    merged = {"rope_theta": config.get("rope_theta")}
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key) or {}
        if not isinstance(value, dict):
            fail(where, f"{key} must be an object, got {type(value).__name__}")
        merged.update(value)
    return merged


def _rope_scaling(params: dict, where: str) -> dict | None:
    """The arguments of `RopeScaling`, or None for plain RoPE."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        fail(where, f"rope scaling {show(rope_type)} is not supported; supported: default, llama3")
    return dict(factor=_hf_value(params, "factor", float, where),
                low_freq_factor=_hf_value(params, "low_freq_factor", float, where),
                high_freq_factor=_hf_value(params, "high_freq_factor", float, where),
                original_max_seq_len=_hf_value(params, "original_max_position_embeddings", int, where))
