"""HF import/export and the fastml checkpoint format (tensordir.py): tiny random HF models of every supported
family give the same logits in our model, conversion both ways is bit-exact, and bad inputs are UserErrors."""

import dataclasses
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastml.config import UserError
from fastml.executor.storage.hf import (convert_from_hf, convert_to_hf, fastml_to_hf, hf_to_fastml, load_pretrained,
                                read_hf_tensors, save_hf)
from fastml.executor.storage.tensordir import load_checkpoint, load_json_file, load_tensor_file, save_checkpoint
from fastml.executor.model.transformer import build_model, materialize, rotary_tables
from fastml.spec import PRESETS

VOCAB = 128
SEQ = 48
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)

FAMILIES = {
    "llama-gqa": ("LlamaForCausalLM", "LlamaConfig",
                  dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "llama3-rope": ("LlamaForCausalLM", "LlamaConfig", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None)),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32)),
}


def hf_model(family, seed=0, dtype=torch.float32):
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**SMALL, **extra, attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF initializes norms to ones and biases to zeros: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model.to(dtype)


def tokens(seed=1):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(model):
    with torch.no_grad():
        return model(tokens()).logits


def our_logits(model):
    with torch.no_grad():
        return model.logits(tokens())


def saved(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    return path


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_pretrained_matches_hf_logits(family, tmp_path):
    hf = hf_model(family)
    ours = load_pretrained(saved(hf, tmp_path))
    reference = hf_logits(hf)
    assert reference.abs().max() > 1.0  # logits large enough that a 1e-4 match means something
    assert max_diff(our_logits(ours), reference) <= 1e-4


def test_spec_read_from_each_family(tmp_path):
    specs = {f: load_pretrained(saved(hf_model(f), tmp_path / f)).spec for f in FAMILIES}
    assert specs["llama-gqa"].num_kv_heads == 2 and specs["llama-gqa"].rope_theta == 500000.0
    assert specs["llama3-rope"].rope_scaling.original_max_seq_len == 64
    assert specs["qwen2-tied"].tied_embeddings and specs["qwen2-tied"].qkv_bias
    assert specs["qwen3-qknorm"].qk_norm and specs["qwen3-qknorm"].head_dim == 32
    assert not any(s.qkv_bias for f, s in specs.items() if f != "qwen2-tied")


def test_llama3_rope_scaling_changes_frequencies_and_logits(tmp_path):
    hf = hf_model("llama3-rope")
    ours = load_pretrained(saved(hf, tmp_path))
    unscaled = dataclasses.replace(ours.spec, rope_scaling=None)
    cos_scaled, _ = rotary_tables(ours.spec, SEQ, "cpu", torch.float32)
    cos_plain, _ = rotary_tables(unscaled, SEQ, "cpu", torch.float32)
    assert max_diff(cos_scaled, cos_plain) > 0.1  # scaling is active at this sequence length
    # Without the scaling our model would not match HF: the logit comparison above can fail.
    plain = build_model(unscaled)
    plain.load_state_dict(ours.state_dict(), assign=True)
    assert max_diff(our_logits(plain), hf_logits(hf)) > 1e-3


def test_tied_model_has_no_lm_head(tmp_path):
    ours = load_pretrained(saved(hf_model("qwen2-tied"), tmp_path))
    assert ours.lm_head is None
    assert "lm_head.weight" not in read_hf_tensors(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("llama-gqa")
    saved(hf, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert max_diff(our_logits(load_pretrained(tmp_path)), hf_logits(hf)) <= 1e-4


def test_load_pretrained_casts_and_gives_trainable_parameters(tmp_path):
    ours = load_pretrained(saved(hf_model("qwen3-qknorm"), tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert all(p.requires_grad and not p.is_meta for p in ours.parameters())


@pytest.mark.parametrize("family,dtype,shard", [("llama3-rope", torch.float32, "40KB"),
                                                ("qwen2-tied", torch.bfloat16, None),
                                                ("mistral", torch.float32, None)])
def test_convert_round_trip_is_exact(family, dtype, shard, tmp_path):
    hf = hf_model(family, dtype=dtype)
    saved(hf, tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    convert_from_hf(tmp_path / "hf", tmp_path / "ckpt")
    convert_to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for name, t in original.items():
        assert back[name].dtype == t.dtype == dtype and torch.equal(back[name], t), name
    # Compared with the original directory as loaded by transformers, not with `hf`: `.to(bfloat16)` also cast
    # its rotary frequencies, which from_pretrained keeps in float32.
    first, reloaded = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d, attn_implementation="eager")
                       for d in ("hf", "back"))
    assert type(reloaded) is type(hf) and reloaded.dtype == dtype
    assert torch.equal(hf_logits(reloaded.eval()), hf_logits(first.eval()))


@pytest.mark.parametrize("family", ["llama3-rope", "qwen2-tied", "qwen3-qknorm"])
def test_save_hf_config_from_spec_loads_in_transformers(family, tmp_path):
    hf = hf_model(family)
    ours = load_pretrained(saved(hf, tmp_path / "hf"))
    save_hf(ours.spec, ours.state_dict(), tmp_path / "out", max_shard_bytes=50_000)  # no base config: hf_config
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert config.tie_word_embeddings == ours.spec.tied_embeddings
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert reloaded.dtype == torch.float32
    assert max_diff(hf_logits(reloaded.eval()), hf_logits(hf)) <= 1e-5


def test_mapping_functions_are_inverse_and_exact(tmp_path):
    hf = read_hf_tensors(saved(hf_model("qwen3-qknorm"), tmp_path))
    spec = load_pretrained(tmp_path).spec
    state = hf_to_fastml(spec, hf)
    assert state["blocks.0.attn.qkv.weight"].shape == (spec.q_size + 2 * spec.kv_size, spec.hidden_size)
    back = fastml_to_hf(spec, state)
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)
    with_buffer = dict(hf, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    assert hf_to_fastml(spec, with_buffer).keys() == state.keys()


def test_unknown_missing_and_misshapen_tensors_are_named(tmp_path):
    hf = read_hf_tensors(saved(hf_model("llama-gqa"), tmp_path))
    spec = load_pretrained(tmp_path).spec
    with pytest.raises(UserError, match="unknown tensor 'model.layers.0.mlp.gate_proj.bias'"):
        hf_to_fastml(spec, dict(hf, **{"model.layers.0.mlp.gate_proj.bias": torch.zeros(96)}))
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(UserError, match="missing tensor 'model.layers.1.self_attn.k_proj.weight'"):
        hf_to_fastml(spec, missing)
    with pytest.raises(UserError, match="'model.layers.0.self_attn.v_proj.weight' has shape"):
        hf_to_fastml(spec, dict(hf, **{"model.layers.0.self_attn.v_proj.weight": torch.zeros(16, 64)}))
    state = hf_to_fastml(spec, hf)
    with pytest.raises(UserError, match="missing tensor 'lm_head.weight'"):
        fastml_to_hf(spec, {k: v for k, v in state.items() if k != "lm_head.weight"})


def test_tied_head_that_differs_from_embedding_is_rejected(tmp_path):
    hf = read_hf_tensors(saved(hf_model("qwen2-tied"), tmp_path))
    spec = load_pretrained(tmp_path).spec
    same = dict(hf, **{"lm_head.weight": hf["model.embed_tokens.weight"].clone()})
    assert "lm_head.weight" not in hf_to_fastml(spec, same)
    with pytest.raises(UserError, match="lm_head.weight"):
        hf_to_fastml(spec, dict(hf, **{"lm_head.weight": torch.randn_like(hf["model.embed_tokens.weight"])}))


def test_pickle_only_directory_is_rejected(tmp_path):
    hf_model("llama-gqa").config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(UserError, match="pytorch_model.bin.*not supported.*arbitrary code"):
        load_pretrained(tmp_path)


def test_unsupported_model_type_is_rejected(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        load_pretrained(tmp_path)


def test_corrupt_safetensors_and_index_are_user_errors(tmp_path):
    saved(hf_model("llama-gqa"), tmp_path / "a")
    (tmp_path / "a" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_pretrained(tmp_path / "a")
    saved(hf_model("llama-gqa"), tmp_path / "b", max_shard_size="40KB")
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../model.safetensors"
    (tmp_path / "b" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="must be a file name"):
        read_hf_tensors(tmp_path / "b")


def tiny_state(**changes):
    spec = dataclasses.replace(PRESETS["tiny"], num_layers=2, **changes)
    return spec, materialize(build_model(spec), "cpu", torch.float32, seed=3).state_dict()


def test_fastml_checkpoint_round_trip(tmp_path):
    spec, state = tiny_state(qkv_bias=True, qk_norm=True, tied_embeddings=True)
    extra = {"notes.json": {"step": 7, "data": {"position": 123}}}
    save_checkpoint(tmp_path / "ckpt", spec, state, tensor_files={"more.safetensors": {"x": torch.ones(3)}},
                    json_files=extra)
    loaded_spec, loaded, manifest = load_checkpoint(tmp_path / "ckpt")
    assert loaded_spec == spec and manifest.training is None
    assert load_json_file(tmp_path / "ckpt", "notes.json") == extra["notes.json"]
    assert torch.equal(load_tensor_file(tmp_path / "ckpt", "more.safetensors")["x"], torch.ones(3))
    assert manifest.format == "fastml-checkpoint" and manifest.version == 2
    assert sorted(manifest.files) == ["model.safetensors", "more.safetensors", "notes.json"]
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[n], state[n]) for n in state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind


def test_fastml_checkpoint_replaces_only_checkpoints(tmp_path):
    spec, state = tiny_state()
    save_checkpoint(tmp_path / "ckpt", spec, state, json_files={"n.json": {"step": 1}})
    save_checkpoint(tmp_path / "ckpt", spec, state, json_files={"n.json": {"step": 2}})
    assert load_json_file(tmp_path / "ckpt", "n.json") == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a fastml checkpoint; refusing"):
        save_checkpoint(tmp_path / "mine", spec, state)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    hf_dir = saved(hf_model("llama-gqa"), tmp_path / "hf")  # config.json and model.safetensors: not ours either
    with pytest.raises(UserError, match="hf: exists and is not a fastml checkpoint; refusing"):
        convert_from_hf(hf_dir, hf_dir)
    assert (hf_dir / "config.json").is_file()
    save_checkpoint(tmp_path / "plain", spec, state)
    (tmp_path / "plain" / "fastml.json").unlink()  # what is left of a damaged one of ours may be replaced
    save_checkpoint(tmp_path / "plain", spec, state)
    shutil.rmtree(tmp_path / "plain")
    for files in ({"json_files": {"fastml.json": {}}}, {"json_files": {"a.bin": {}}},
                  {"tensor_files": {"a.json": {}}}):
        with pytest.raises(UserError, match="tensors go in .safetensors files, other data in .json files"):
            save_checkpoint(tmp_path / "x", spec, state, **files)
    with pytest.raises(UserError, match="missing tensor 'norm.weight'"):
        save_checkpoint(tmp_path / "x", spec, {k: v for k, v in state.items() if k != "norm.weight"})
    assert not (tmp_path / "x").exists()


def test_malformed_fastml_checkpoints_are_user_errors(tmp_path):
    spec, state = tiny_state()
    with pytest.raises(UserError, match="not a fastml checkpoint"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path / "ckpt", spec, state)
    meta_path = tmp_path / "ckpt" / "fastml.json"
    meta = json.loads(meta_path.read_text())
    for change, message in [({"version": 99}, "version: 99 is not supported; this fastml reads version 2"),
                            ({"format": "other"}, "format: 'other' is not allowed"),
                            ({"files": {"../model.safetensors": meta["files"]["model.safetensors"]}},
                             "must name a file of the checkpoint directory"),
                            ({"files": "abc"}, "files: expected an object"),
                            ({"training": {"step": "one"}}, "training.step: expected int"),
                            ({"model": dict(meta["model"], num_layers=3)}, "missing tensor 'blocks.2"),
                            ({"model": dict(meta["model"], bogus=1)}, "model.bogus: unknown key"),
                            ({"bogus": 1}, "bogus: unknown key")]:
        meta_path.write_text(json.dumps(dict(meta, **change)))
        with pytest.raises(UserError, match=message):
            load_checkpoint(tmp_path / "ckpt")
    meta_path.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_checkpoint(tmp_path / "ckpt")
    meta_path.write_text(json.dumps(meta))
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="model.safetensors: missing"):
        load_checkpoint(tmp_path / "ckpt")
