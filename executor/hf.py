"""Checkpoints: HF safetensors import/export, and fastml's own atomic checkpoint directory.

HF Llama-family checkpoints keep q, k, v and gate, up as separate tensors; our model fuses them (`attn.qkv`,
`ffn.gate_up`), so conversion concatenates or splits along dim 0 and never changes a dtype or a value. Only
safetensors files are read: a pickle (`pytorch_model.bin`) can run arbitrary code when loaded.

fastml's checkpoint is a directory with `model.safetensors` (our names) and `fastml.json` (format, version, the
model spec, and whatever else the caller adds), written into a temporary sibling and renamed into place, so a
crash never leaves a half-written checkpoint under the real name.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fastml.config import UserError, check_range, fail, from_dict, to_dict
from fastml.executor.files import fsync, read_json_object, write_dir_atomically
from fastml.executor.model import Transformer, build_model
from fastml.spec import ModelSpec, hf_config, resolve_model, spec_from_hf_config

CHECKPOINT_FORMAT = "fastml-checkpoint"
CHECKPOINT_VERSION = 1
MODEL_FILE = "model.safetensors"
META_FILE = "fastml.json"
HF_INDEX_FILE = "model.safetensors.index.json"

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

@functools.lru_cache(maxsize=8)
def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Our tensor names and shapes, read off the model built on the meta device (so they cannot drift)."""
    return {name: tuple(t.shape) for name, t in build_model(spec).state_dict().items()}


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


def _name_mismatch(names, expected) -> str | None:
    # Unknown names first: a missing tensor is often only the consequence of a misnamed one.
    for kind, bad in (("unknown", set(names) - set(expected)), ("missing", set(expected) - set(names))):
        if bad:
            return f"{kind} tensor {sorted(bad)[0]!r} ({len(bad)} {kind} in all)"
    return None


def _check_state_dict(spec: ModelSpec, state_dict: dict, where: str) -> None:
    shapes = _expected_shapes(spec)
    if mismatch := _name_mismatch(state_dict, shapes):
        fail(where, mismatch)
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != shape:
            fail(where, f"tensor {name!r} has shape {tuple(state_dict[name].shape)}, the model needs {shape}")


def hf_to_fastml(spec: ModelSpec, hf_tensors: dict) -> dict:
    """HF Llama/Mistral/Qwen2/Qwen3 tensors -> our state dict, fused; values and dtypes unchanged."""
    return _take_hf(spec, dict(hf_tensors))


def _take_hf(spec: ModelSpec, tensors: dict) -> dict:
    """`hf_to_fastml` that pops what it uses from `tensors`: each original can be freed once it is fused."""
    for name in [n for n in tensors if n.endswith(_IGNORED_HF_SUFFIX)]:
        del tensors[name]
    where = f"HF checkpoint {spec.name}"
    if spec.tied_embeddings:
        _drop_tied_head(tensors, where)
    shapes = _expected_shapes(spec)
    if mismatch := _name_mismatch(tensors, [h for name in shapes for h in _hf_parts(name)]):
        fail(where, mismatch)
    return {name: _fuse(spec, name, [(h, tensors.pop(h)) for h in _hf_parts(name)], shape, where)
            for name, shape in shapes.items()}


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
    return {name: _compact(t) for name, t in _hf_views(spec, state_dict).items()}


def _hf_views(spec: ModelSpec, state_dict: dict) -> dict[str, torch.Tensor]:
    """HF names -> views into our tensors (no copy yet: `save_hf` copies one shard at a time)."""
    _check_state_dict(spec, state_dict, "state_dict")
    views = {}
    for name in _expected_shapes(spec):
        t = state_dict[name].detach()
        views.update(zip(_hf_parts(name), t.split(_split_sizes(spec, name, t.shape[0]))))
    return views


def _compact(t: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage, such as the q/k/v slices of one fused tensor.
    covers_storage = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.contiguous() if covers_storage else t.clone(memory_format=torch.contiguous_format)


# ---- HF directories -----------------------------------------------------------------------------------------

def read_hf_tensors(directory) -> dict:
    """All tensors of an HF model directory: `model.safetensors`, or the shards of `model.safetensors.index.json`."""
    directory = Path(directory)
    if not directory.is_dir():
        fail(str(directory), "not a directory")
    if (directory / MODEL_FILE).is_file():
        return _read_safetensors(directory / MODEL_FILE)
    if (directory / HF_INDEX_FILE).is_file():
        return _read_shards(directory)
    if any((directory / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        fail(str(directory), "only pytorch_model.bin found, which is not supported: it is a pickle, and loading an "
                             "untrusted pickle can run arbitrary code; convert it to safetensors with a trusted tool")
    fail(str(directory), f"no {MODEL_FILE} or {HF_INDEX_FILE}")


def _read_safetensors(path: Path) -> dict:
    if not path.is_file():
        fail(str(path), "missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None


def _read_shards(directory: Path) -> dict:
    index_path = directory / HF_INDEX_FILE
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        fail(str(index_path), "'weight_map' must map tensor names to shard file names")
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard in ("", ".", ".."):
            fail(str(index_path), f"shard {shard!r} must be a file name inside {directory}")
        for name, t in _read_safetensors(directory / shard).items():
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
        _write_safetensors(views, directory / MODEL_FILE)
    else:
        _write_shards(views, shards, directory)
    _write_json(directory / "config.json", _export_config(spec, views["model.embed_tokens.weight"].dtype,
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
        _write_safetensors({n: views[n] for n in names}, directory / file)
        weight_map.update(dict.fromkeys(names, file))
    total_bytes = sum(t.numel() * t.element_size() for t in views.values())
    _write_json(directory / HF_INDEX_FILE, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})


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


# ---- fastml checkpoints -------------------------------------------------------------------------------------

def save_checkpoint(directory, spec: ModelSpec, state_dict: dict, extra: dict | None = None,
                    tensor_files: dict[str, dict] | None = None, after_each_file=None) -> None:
    """Writes a fastml checkpoint atomically: model.safetensors, any further safetensors files (name -> tensors,
    e.g. optimizer state), and fastml.json with the spec, `extra` (JSON values) and a SHA-256 per file.

    An existing directory is replaced only if it is empty or a fastml checkpoint."""
    _check_state_dict(spec, state_dict, "state_dict")
    meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "model": to_dict(spec)}
    clash = sorted(set(extra or {}) & (set(meta) | {"files"}))
    if clash:
        fail("save_checkpoint", f"extra key {clash[0]!r} is reserved")
    meta.update(extra or {})
    json.dumps(meta)  # before any file is written: a value that is not JSON fails here

    def write(tmp: Path) -> None:
        checksums = {}
        for name, tensors in {MODEL_FILE: state_dict, **(tensor_files or {})}.items():
            _write_safetensors(tensors, tmp / name)
            checksums[name] = _sha256(tmp / name)
            if after_each_file:
                after_each_file()
        (tmp / META_FILE).write_text(json.dumps({**meta, "files": checksums}, indent=2))

    write_dir_atomically(directory, write, _is_checkpoint, "a fastml checkpoint")


def _is_checkpoint(directory: Path) -> bool:
    """One of ours, or what is left of one (a damaged checkpoint may be replaced): only our kinds of files."""
    return all(p.is_file() and (p.name == META_FILE or p.suffix == ".safetensors") for p in directory.iterdir())


def load_checkpoint(directory) -> tuple[ModelSpec, dict, dict]:
    """(spec, state dict, the whole fastml.json) of a checkpoint written by `save_checkpoint`, after checking
    that every file it lists is there, whole and unchanged."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        fail(str(directory), f"not a fastml checkpoint (no {META_FILE})")
    meta = read_json_object(meta_path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        fail(str(meta_path), f"'format' is {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    if meta.get("version") != CHECKPOINT_VERSION:
        fail(str(meta_path), f"version {meta.get('version')!r} is not supported; this fastml reads version "
                             f"{CHECKPOINT_VERSION}")
    if "model" not in meta:
        fail(str(meta_path), "missing key 'model'")
    try:
        spec = from_dict(ModelSpec, meta["model"], "model")
    except UserError as e:
        raise UserError(f"{meta_path}: {e}") from None
    _verify_files(directory, meta.get("files", {MODEL_FILE: None}))
    state = _read_safetensors(directory / MODEL_FILE)
    _check_state_dict(spec, state, str(directory / MODEL_FILE))
    return spec, state, meta


def load_tensor_file(directory, name: str) -> dict:
    """Another safetensors file of a checkpoint (already verified by `load_checkpoint`)."""
    return _read_safetensors(Path(directory) / name)


def _verify_files(directory: Path, checksums: dict) -> None:
    if not isinstance(checksums, dict):
        fail(str(directory / META_FILE), "'files' must map file names to SHA-256 digests")
    for name, digest in checksums.items():
        path = directory / name
        if Path(name).name != name or not path.is_file():
            fail(str(path), "missing from the checkpoint")
        if digest is not None and _sha256(path) != digest:
            fail(str(path), "checksum mismatch: the file was truncated or changed after it was written")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


# ---- conversion -------------------------------------------------------------------------------------------

def convert_from_hf(hf_dir, out_dir) -> ModelSpec:
    """`fastml convert --from-hf HF_DIR -o OUT_DIR`: an HF model directory -> a fastml checkpoint.

    The HF config.json is kept in fastml.json so that `convert_to_hf` can write it back unchanged."""
    hf_dir = Path(hf_dir)
    spec = _hf_spec(hf_dir)
    state = _take_hf(spec, read_hf_tensors(hf_dir))
    save_checkpoint(out_dir, spec, state, extra={"hf_config": read_json_object(hf_dir / "config.json")})
    return spec


def convert_to_hf(ckpt_dir, hf_dir, max_shard_bytes: int = 5 * 2**30) -> ModelSpec:
    """`fastml convert CKPT_DIR --to-hf HF_DIR`: a fastml checkpoint -> an HF model directory."""
    spec, state, meta = load_checkpoint(ckpt_dir)
    save_hf(spec, state, hf_dir, max_shard_bytes, base_config=meta.get("hf_config"))
    return spec


# ---- files --------------------------------------------------------------------------------------------------

def _write_safetensors(tensors: dict, path: Path) -> None:
    # "format": "pt" is what transformers expects in the header of a PyTorch safetensors file.
    save_file({name: _compact(t.detach().cpu()) for name, t in tensors.items()}, path, metadata={"format": "pt"})
    fsync(path)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
    fsync(path)

