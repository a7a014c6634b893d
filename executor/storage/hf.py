"""HF safetensors import and export.

HF Llama-family checkpoints keep q, k, v and gate, up as separate tensors; our model fuses them (`attn.qkv`,
`ffn.gate_up`), so conversion concatenates or splits along dim 0 and never changes a dtype or a value. Only
safetensors files are read: a pickle (`pytorch_model.bin`) can run arbitrary code when loaded. `fastml convert`
turns an HF model directory into a fastml checkpoint (tensordir.py) and back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from fastml.config import UserError, check_range, fail
from fastml.executor.storage.files import compact, read_json_object, read_safetensors, write_json, write_safetensors
from fastml.executor.model.transformer import Transformer, build_model
from fastml.executor.storage.tensordir import (check_state_dict, load_checkpoint, load_json_file, model_shapes,
                                       name_mismatch, save_checkpoint)
from fastml.spec import ModelSpec, hf_config, resolve_model, spec_from_hf_config

MODEL_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
HF_CONFIG_FILE = "hf_config.json"
"""The HF config.json a fastml checkpoint was imported from, kept in it so that export can write it back."""

# Our name -> the HF names it is made of, concatenated along dim 0 in this order.
_TOP_PARTS = {
    "embed.weight": ("model.embed_tokens.weight",),
    "norm.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
}
# The same inside block i / HF layer i.
_BLOCK_PARTS = {
    "attn_norm.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
    "attn.out.weight": ("self_attn.o_proj.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
    "ffn.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "ffn.down.weight": ("mlp.down_proj.weight",),
}
# Old HF checkpoints saved the rotary frequencies; we recompute them from the config.
_IGNORED_HF_SUFFIX = "rotary_emb.inv_freq"


# ---- name mapping -------------------------------------------------------------------------------------------

def _hf_parts(name: str) -> tuple[str, ...]:
    if name in _TOP_PARTS:
        return _TOP_PARTS[name]
    _, layer, rest = name.split(".", 2)  # blocks.{i}.rest
    return tuple(f"model.layers.{layer}.{part}" for part in _BLOCK_PARTS[rest])


def _split_sizes(spec: ModelSpec, name: str, dim0: int) -> list[int]:
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return [spec.q_size, spec.kv_size, spec.kv_size]
    if name.endswith("ffn.gate_up.weight"):
        return [spec.ffn_hidden_size, spec.ffn_hidden_size]
    return [dim0]


def hf_to_fastml(spec: ModelSpec, hf_tensors: dict) -> dict:
    """HF Llama/Mistral/Qwen2/Qwen3 tensors -> our state dict, fused; values and dtypes unchanged."""
    return _take_hf(spec, dict(hf_tensors))


def _take_hf(spec: ModelSpec, tensors: dict) -> dict:
    """`hf_to_fastml` that pops what it uses from `tensors`: each original can be freed once it is fused."""
    fuse = _hf_fuser(spec, tensors, f"HF checkpoint {spec.name}")
    return {name: fuse(name) for name in model_shapes(spec)}


def _hf_fuser(spec: ModelSpec, tensors: dict, where: str) -> Callable[[str], torch.Tensor]:
    """Checks the names of the HF `tensors` against `spec`, then returns the function that makes our tensor `name` of
    its HF parts, popping them from `tensors`: taken one name at a time, one fused tensor exists at a time. `where`
    names the checkpoint in errors."""
    for name in [n for n in tensors if n.endswith(_IGNORED_HF_SUFFIX)]:
        del tensors[name]
    if spec.tied_embeddings:
        _drop_tied_head(tensors, where)
    shapes = model_shapes(spec)
    if mismatch := name_mismatch(tensors, [h for name in shapes for h in _hf_parts(name)]):
        fail(where, mismatch)
    return lambda name: _fuse(spec, name, [(h, tensors.pop(h)) for h in _hf_parts(name)], shapes[name], where)


def hf_weights(directory, spec: ModelSpec) -> Callable[[str], torch.Tensor]:
    """Our tensor `name` of the weights of an HF model directory whose config describes `spec`, one at a time: its
    files are memory-mapped (safetensors), so only the tensor being fused takes memory of its own."""
    return _hf_fuser(spec, read_hf_tensors(directory), f"HF checkpoint {directory}")


def _drop_tied_head(tensors: dict, where: str) -> None:
    # Some exporters write the tied LM head anyway; it is only acceptable as an exact copy of the embedding.
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if head is None:
        return
    if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
        fail(where, "tensor 'lm_head.weight' differs from the embedding, but the config says "
                    "tie_word_embeddings=true")
    del tensors["lm_head.weight"]


def _fuse(spec: ModelSpec, name: str, parts: list, shape: tuple[int, ...], where: str) -> torch.Tensor:
    for (hf_name, t), size in zip(parts, _split_sizes(spec, name, shape[0])):
        if tuple(t.shape) != (size, *shape[1:]):
            fail(where, f"tensor {hf_name!r} has shape {tuple(t.shape)}, the config needs {(size, *shape[1:])}")
    if len({t.dtype for _, t in parts}) > 1:
        # torch.cat would silently promote; a conversion must not change a dtype.
        fail(where, f"tensors {', '.join(h for h, _ in parts)} have different dtypes")
    return parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts])


def fastml_to_hf(spec: ModelSpec, state_dict: dict) -> dict:
    """Our state dict -> HF tensor names, split; values and dtypes unchanged, each tensor with its own storage."""
    return {name: compact(t) for name, t in _hf_views(spec, state_dict).items()}


def _hf_views(spec: ModelSpec, state_dict: dict) -> dict[str, torch.Tensor]:
    """HF names -> views into our tensors (no copy yet: `save_hf` copies one shard at a time)."""
    check_state_dict(spec, state_dict, "state_dict")
    views = {}
    for name in model_shapes(spec):
        t = state_dict[name].detach()
        views.update(zip(_hf_parts(name), t.split(_split_sizes(spec, name, t.shape[0]))))
    return views


# ---- HF directories -----------------------------------------------------------------------------------------

def read_hf_tensors(directory) -> dict:
    """All tensors of an HF model directory: `model.safetensors`, or the shards of `model.safetensors.index.json`."""
    directory = Path(directory)
    if not directory.is_dir():
        fail(str(directory), "not a directory")
    if (directory / MODEL_FILE).is_file():
        return read_safetensors(directory / MODEL_FILE)
    if (directory / HF_INDEX_FILE).is_file():
        return _read_shards(directory)
    if any((directory / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        fail(str(directory), "only pytorch_model.bin found, which is not supported: it is a pickle, and loading an "
                             "untrusted pickle can run arbitrary code; convert it to safetensors with a trusted tool")
    fail(str(directory), f"no {MODEL_FILE} or {HF_INDEX_FILE}")


def _read_shards(directory: Path) -> dict:
    index_path = directory / HF_INDEX_FILE
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        fail(str(index_path), "'weight_map' must map tensor names to shard file names")
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard in ("", ".", ".."):
            fail(str(index_path), f"shard {shard!r} must be a file name inside {directory}")
        for name, t in read_safetensors(directory / shard).items():
            if weight_map.get(name) != shard:
                fail(str(directory / shard), f"tensor {name!r} is not listed for this shard in {HF_INDEX_FILE}")
            tensors[name] = t
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        fail(str(index_path), f"tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]!r}")
    return tensors


def _hf_spec(directory: Path) -> ModelSpec:
    config_path = directory / "config.json"
    if not config_path.is_file():
        fail(str(directory), "no config.json")
    return resolve_model(str(config_path))  # a file path, so never mistaken for a preset name


def load_pretrained(directory, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Transformer:
    """Our model with the weights of an HF model directory; dtype None keeps each tensor's dtype from the file.

    The model is built on the meta device and takes the loaded tensors as its parameters (assign=True), so no
    weight is allocated twice."""
    directory = Path(directory)
    spec = _hf_spec(directory)
    state = _take_hf(spec, read_hf_tensors(directory))
    for name in list(state):  # one tensor at a time, so each host copy is freed as soon as it has moved
        state[name] = state[name].to(device=device, dtype=dtype)
    model = build_model(spec)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_hf(spec: ModelSpec, state_dict: dict, directory, max_shard_bytes: int = 5 * 2**30,
            base_config: dict | None = None) -> None:
    """An HF model directory: config.json and model.safetensors, or shards and an index beyond max_shard_bytes.

    base_config, an HF config.json this model was imported from, is kept (family, token ids, max positions)
    when it still describes `spec`; otherwise the config comes from `hf_config(spec)`."""
    check_range("max_shard_bytes", max_shard_bytes, 1)
    views = _hf_views(spec, state_dict)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_hf_weights(directory)
    shards = _plan_shards(views, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(views, directory / MODEL_FILE)
    else:
        _write_shards(views, shards, directory)
    write_json(directory / "config.json", _export_config(spec, views["model.embed_tokens.weight"].dtype,
                                                          base_config))


def _remove_hf_weights(directory: Path) -> None:
    # Weights left from an earlier export with other sharding would be read instead of, or mixed with, the new.
    for path in [directory / MODEL_FILE, directory / HF_INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]:
        path.unlink(missing_ok=True)


def _plan_shards(views: dict, max_shard_bytes: int) -> list[list[str]]:
    """Names grouped greedily in model order; a tensor larger than the limit gets a shard of its own."""
    shards, size = [[]], 0
    for name, t in views.items():
        num_bytes = t.numel() * t.element_size()
        if shards[-1] and size + num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += num_bytes
    return shards


def _write_shards(views: dict, shards: list[list[str]], directory: Path) -> None:
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors({n: views[n] for n in names}, directory / file)
        weight_map.update(dict.fromkeys(names, file))
    total_bytes = sum(t.numel() * t.element_size() for t in views.values())
    write_json(directory / HF_INDEX_FILE, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})


def _export_config(spec: ModelSpec, dtype: torch.dtype, base_config: dict | None) -> dict:
    # transformers loads with the config's dtype by default: it must name the dtype actually written.
    dtype_name = str(dtype).removeprefix("torch.")
    if not _describes(base_config, spec):
        return hf_config(spec, dtype=dtype_name)
    return dict(base_config, dtype=dtype_name, torch_dtype=dtype_name)


def _describes(base_config: dict | None, spec: ModelSpec) -> bool:
    if not isinstance(base_config, dict):
        return False
    try:
        return spec_from_hf_config(base_config, name=spec.name) == spec
    except UserError:
        return False


# ---- conversion -------------------------------------------------------------------------------------------

def convert_from_hf(hf_dir, out_dir) -> ModelSpec:
    """`fastml convert --from-hf HF_DIR -o OUT_DIR`: an HF model directory -> a fastml checkpoint.

    The HF config.json is kept in the checkpoint (hf_config.json) so that `convert_to_hf` can write it back."""
    hf_dir = Path(hf_dir)
    spec = _hf_spec(hf_dir)
    state = _take_hf(spec, read_hf_tensors(hf_dir))
    save_checkpoint(out_dir, spec, state, json_files={HF_CONFIG_FILE: read_json_object(hf_dir / "config.json")})
    return spec


def convert_to_hf(ckpt_dir, hf_dir, max_shard_bytes: int = 5 * 2**30) -> ModelSpec:
    """`fastml convert CKPT_DIR --to-hf HF_DIR`: a fastml checkpoint -> an HF model directory."""
    spec, state, manifest = load_checkpoint(ckpt_dir)
    base_config = load_json_file(ckpt_dir, HF_CONFIG_FILE) if HF_CONFIG_FILE in manifest.files else None
    save_hf(spec, state, hf_dir, max_shard_bytes, base_config=base_config)
    return spec
