"""The contract: plan.json validation, overrides, and model specs."""

import dataclasses
import functools
import json

import pytest

from fastml.config import UserError
from fastml.plan import KNOBS, Plan, Training, load_plan, pinned, plan_from_dict, save_plan, with_overrides
from fastml.planner.planner import make_plan
from fastml.spec import PRESETS, hf_config, resolve_model, spec_from_hf_config


def cpu_plan(**kwargs):
    return make_plan(device="cpu", **kwargs).plan


@functools.cache
def _plan_json() -> str:
    return cpu_plan(steps=5).to_json()


def plan_dict() -> dict:
    """The default CPU plan as a dict of the test's own to edit (searched once for the module's tests)."""
    return json.loads(_plan_json())


def test_default_plan_round_trips_through_json(tmp_path):
    plan = cpu_plan(steps=5)
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan
    assert plan.model == PRESETS["tiny"]
    assert plan.knobs.micro_batch_size * plan.knobs.grad_accum_steps * plan.training.seq_len == \
        plan.training.global_batch_tokens


@pytest.mark.parametrize("path, value, match", [
    (("knobs", "bogus"), 1, r"knobs\.bogus: unknown key; allowed keys are micro_batch_size"),
    (("knobs", "matmul_dtype"), "fp16", r"knobs\.matmul_dtype: 'fp16' is not allowed; choose one of 'fp32', 'bf16', 'fp8'"),
    (("knobs", "recompute"), ["block", "mlp"], r"knobs\.recompute\[1\]: 'mlp' is not allowed"),
    (("knobs", "micro_batch_size"), 0, r"knobs\.micro_batch_size: 0 is outside"),
    (("knobs", "offload_weights"), 1.5, r"knobs\.offload_weights: 1\.5 is outside the allowed range \[0\.0, 1\.0\]"),
    (("knobs", "compile"), 1, r"knobs\.compile: expected bool, got 1"),
    (("training", "seq_len"), "256", r"training\.seq_len: expected int, got '256'"),
    (("training", "global_batch_tokens"), 1000, r"training\.global_batch_tokens: 1000 must equal"),
    (("model", "num_kv_heads"), 3, r"model\.num_kv_heads: 3 must divide num_heads=4"),
    (("version",), 99, r"version: plan version 99 is not supported"),
])
def test_bad_values_name_the_field(path, value, match):
    data = plan_dict()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(UserError, match=match):
        plan_from_dict(data)


def test_missing_model_is_an_error():
    data = plan_dict()
    del data["model"]
    with pytest.raises(UserError, match="model: missing required key"):
        plan_from_dict(data)


def test_loaded_knobs_are_tuples_and_hashable():
    """The search keys candidates by their knobs: knobs read from JSON (where recompute is a list) must be equal,
    and hash equal, to the same knobs built in Python."""
    plan = cpu_plan(steps=5, overrides=['knobs.recompute=["ffn","attention"]'])
    loaded = plan_from_dict(json.loads(plan.to_json()))
    assert loaded.knobs.recompute == ("ffn", "attention") and isinstance(loaded.knobs.recompute, tuple)
    assert {loaded.knobs: "found"}[dataclasses.replace(plan.knobs, recompute=("ffn", "attention"))] == "found"


def test_malformed_and_missing_files(tmp_path):
    with pytest.raises(UserError, match="no such plan file"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_plan(tmp_path / "bad.json")


def test_overrides_are_validated():
    plan = cpu_plan(steps=5)
    assert with_overrides(plan, ["knobs.recompute=block,ffn"]).knobs.recompute == ("block", "ffn")
    assert with_overrides(plan, ["training.lr=0.01"]).training.lr == 0.01
    with pytest.raises(UserError, match="SECTION.FIELD=VALUE"):
        with_overrides(plan, ["lr=0.01"])
    with pytest.raises(UserError, match="knobs.compile: expected bool"):
        with_overrides(plan, ["knobs.compile=yes"])


@pytest.mark.parametrize("value, parts", [("[]", ()), ('["block","norm"]', ("block", "norm")),
                                          ("block,norm", ("block", "norm")), ("block", ("block",)), ("", ())])
def test_recompute_overrides_take_json_lists_and_commas(value, parts):
    """`--set knobs.recompute=...` as a JSON list or as comma-separated names (a JSON list was once kept as text)."""
    plan = Plan(model=resolve_model("tiny"), training=Training(global_batch_tokens=256))
    assert with_overrides(plan, [f"knobs.recompute={value}"]).knobs.recompute == parts


def test_text_fields_keep_text_that_looks_like_json():
    plan = Plan(model=resolve_model("tiny"), training=Training(global_batch_tokens=256))
    assert with_overrides(plan, ["training.data=123"]).training.data == "123"
    assert with_overrides(plan, ["training.checkpoint_dir=null"]).training.checkpoint_dir is None


def test_pinned_pins_every_searched_knob():
    plan = with_overrides(Plan(model=resolve_model("tiny"), training=Training(global_batch_tokens=256)), pinned(recompute=("block",), compile=True))
    assert plan.knobs.recompute == ("block",) and plan.knobs.compile and plan.knobs.micro_batch_size == 1
    assert {a.partition("=")[0] for a in pinned()} >= {f"knobs.{n}" for n, i in KNOBS.items()
                                                      if i.kind not in ("batch", "precision")}
    # A ZeRO stage given on brings the stages below it on: pinned off, they would contradict it (planner/pins.py).
    zero3 = with_overrides(Plan(model=resolve_model("tiny"), training=Training(global_batch_tokens=256)),
                           pinned(shard_weights=True)).knobs
    assert zero3.shard_optimizer and zero3.shard_gradients and zero3.shard_weights


def test_pinned_micro_batch_derives_accumulation():
    # tiny's own seq 256 and 16 sequences, whose shapes the default plan has had measured on this CPU (others would
    # be measured first)
    plan = cpu_plan(model="tiny", seq_len=256, global_batch_tokens=256 * 16, overrides=["knobs.micro_batch_size=4"])
    assert (plan.knobs.micro_batch_size, plan.knobs.grad_accum_steps) == (4, 4)
    with pytest.raises(UserError, match="must divide the 16 sequences"):
        cpu_plan(seq_len=256, global_batch_tokens=256 * 16, overrides=["knobs.micro_batch_size=5"])
    with pytest.raises(UserError, match="multiple of the sequence length"):
        cpu_plan(seq_len=256, global_batch_tokens=1000)


def test_unknown_model_names_the_presets():
    with pytest.raises(UserError, match="neither a preset .*llama-3.1-8b"):
        resolve_model("gpt-5")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_export_reads_back_as_the_same_spec(name):
    spec = PRESETS[name]
    back = spec_from_hf_config(hf_config(spec), name=spec.name)
    assert back == spec


def test_unsupported_hf_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported; supported: llama, mistral"):
        resolve_model(str(tmp_path))
    llama = hf_config(PRESETS["tiny"])
    for change, message in [({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
                            ({"attention_bias": True}, "attention_bias is not supported for model_type 'llama'"),
                            ({"mlp_bias": True}, "mlp_bias is not supported"),
                            ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window")]:
        with pytest.raises(UserError, match=message):
            spec_from_hf_config(llama | change, name="x")
    config = llama | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    config.pop("rope_parameters")
    with pytest.raises(UserError, match="rope scaling 'yarn' is not supported"):
        spec_from_hf_config(config, name="x")


def test_flops_per_token_follows_the_definition():
    spec = PRESETS["llama-3.1-8b"]
    n_matmul = spec.num_params() - spec.vocab_size * spec.hidden_size - (2 * spec.num_layers + 1) * spec.hidden_size
    assert spec.num_matmul_params() == n_matmul
    assert spec.flops_per_token(2048) == 6 * n_matmul + 6 * 32 * 4096 * 2048
