"""Bad input everywhere a user can give it ends in one line naming the problem and exit code 2, never a traceback.

The plan loader is fuzzed with hypothesis: valid plans mutated at any depth, and arbitrary text and bytes. Every case
must end in a valid `Plan` or a one-line `UserError`; any other exception is a bug in the loader.
"""

import copy
import dataclasses
import functools
import io
import json
import os
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from fastml.cli import main
from fastml.config import UserError
from fastml.executor.storage.data import TOKENS_FILE, TokenData
from fastml.executor.storage.prepare import HFTokenizer, prepare
from fastml.plan import MAX_PLAN_FILE_BYTES, Plan, Training, load_plan, plan_from_dict
from fastml.planner.planner import make_plan
from fastml.spec import PRESETS, resolve_model

FUZZ = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def base_plans() -> tuple[dict, ...]:
    """A CPU plan (no prediction) and two GPU plans with `predicted` filled, one with rope_scaling, as dicts."""
    cpu = make_plan(device="cpu").plan
    gpu = make_plan(model="tiny", hw="h200", gpus=1, trials=10).plan
    llama = make_plan(model="llama-3.1-8b", hw="h200", gpus=8, trials=10).plan  # has rope_scaling
    return tuple(json.loads(p.to_json()) for p in (cpu, gpu, llama))


# Numbers near the edges: zero, negatives, powers of two around int32/int64, beyond float's range, not finite.
EDGE_NUMBERS = [0, -1, 1, 2, 3, 2**16, 2**24 + 1, 2**31, 2**53 + 1, 2**63, 2**64, 10**400, -(10**400), 0.5, -0.0,
                1.0, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan]
scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from(EDGE_NUMBERS) | st.floats()
           | st.text(max_size=20) | st.sampled_from(["", "bf16", "block", "cuda", "default", "a\nb", "\x1b[31m"]))
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=10), children, max_size=4), max_leaves=12)
# Mostly a number near an edge or another scalar, as a leaf of a plan holds; sometimes a whole tree.
replacements = st.sampled_from(EDGE_NUMBERS) | scalars | json_values


DEEPER = st.integers(0, 4)
OPERATIONS = st.sampled_from(["delete", "add", "replace"])
NEW_KEYS = st.text(max_size=12)
"""The strategies `mutate` draws from, made once: hypothesis validates each new strategy it draws from, and making
them afresh at each draw took a fifth of the fuzzing's time."""


def mutate(data, draw) -> object:
    """One random mutation somewhere in `data`: delete a key or item, add an unknown key, or replace a value."""
    parent, key, node = None, None, data
    while isinstance(node, (dict, list)) and node and draw(DEEPER) > 0:  # mostly down to a leaf
        parent, key = node, draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        node = node[key]
    operation = draw(OPERATIONS)
    if operation == "delete" and parent is not None:
        del parent[key]
    elif operation == "add" and isinstance(node, dict):
        node[draw(NEW_KEYS)] = draw(replacements)
    elif parent is None:
        return draw(replacements)
    else:
        parent[key] = draw(replacements)
    return data


def assert_plan_or_one_line_error(path: Path) -> None:
    try:
        plan = load_plan(path)
    except UserError as e:
        message = str(e)
        assert message and len(message.splitlines()) == 1 and "\n" not in message, repr(message)
        assert len(message) < 1000, message
    else:
        assert isinstance(plan, Plan)
        assert plan_from_dict(json.loads(plan.to_json())) == plan


def write_and_check(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "plan.json")
        path.write_bytes(raw)
        assert_plan_or_one_line_error(path)


@FUZZ
@given(st.data())
def test_mutated_plans_load_or_fail_in_one_line(data):
    plan = copy.deepcopy(data.draw(st.sampled_from(base_plans())))
    for _ in range(data.draw(st.integers(1, 3))):
        plan = mutate(plan, data.draw)
    write_and_check(json.dumps(plan).encode())  # NaN and Infinity written as JSON's non-standard literals


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_arbitrary_files_load_or_fail_in_one_line(raw):
    write_and_check(raw)


@settings(max_examples=100, deadline=None, database=None)
@given(st.data())
def test_damaged_plan_text_loads_or_fails_in_one_line(data):
    """Valid plan text cut short, or with one byte changed."""
    raw = bytearray(json.dumps(data.draw(st.sampled_from(base_plans())), indent=2).encode())
    position = data.draw(st.integers(0, len(raw) - 1))
    if data.draw(st.booleans()):
        raw = raw[:position]
    else:
        raw[position] = data.draw(st.integers(0, 255))
    write_and_check(bytes(raw))


@pytest.mark.parametrize("text, match", [
    ("[" * 100000, "nested too deeply"),
    ('{"version": ' + "1" * 5000 + "}", "not a plan"),
    ("\ufeff{}", "not valid JSON"),
    ("", "not valid JSON"),
    ("null", "expected an object"),
])
def test_pathological_json_is_a_user_error(tmp_path, text, match):
    (tmp_path / "p.json").write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=match):
        load_plan(tmp_path / "p.json")


def test_unreadable_plan_paths(tmp_path):
    with pytest.raises(UserError, match="is not a regular file, so not a plan"):
        load_plan(tmp_path)  # a directory
    (tmp_path / "latin1.json").write_bytes(b'{"model": "caf\xe9"}')
    with pytest.raises(UserError, match="not UTF-8"):
        load_plan(tmp_path / "latin1.json")
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate(MAX_PLAN_FILE_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(UserError, match="too large to be a plan"):
        load_plan(tmp_path / "huge.json")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    """Reading a FIFO nobody writes to would block forever: it is refused before it is opened."""
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UserError, match="fifo: is not a regular file, so not a plan"):
        load_plan(tmp_path / "fifo")


@pytest.mark.parametrize("section, key, value, match", [
    ("model", "num_layers", 10**6, r"model\.num_layers: 1000000 is outside the allowed range \[1, 1024\]"),
    ("model", "vocab_size", 2**30, r"model\.vocab_size: .* \[1, 16777216\]"),
    ("model", "hidden_size", 2**18, r"model\.hidden_size"),
    ("model", "rope_theta", 1e300, r"model\.rope_theta"),
    ("model", "rope_scaling", {"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                               "original_max_seq_len": 8192}, r"model\.rope_scaling\.high_freq_factor"),
    ("training", "steps", 10**12, r"training\.steps: .* \[1, 1000000000\]"),
    ("training", "seq_len", 2**21, r"training\.seq_len"),
    ("training", "beta2", 1.0, r"training\.beta2: 1\.0 is outside the allowed range \[0\.0, 1\.0\)"),
    ("training", "lr", 3.0, r"training\.lr"),
    ("training", "seed", -1, r"training\.seed"),
    ("training", "lr", 10**400, r"training\.lr: must be a finite number"),
    ("knobs", "micro_batch_size", 2**17, r"knobs\.micro_batch_size: .* \[1, 65536\]"),
    ("knobs", "lm_head_chunks", 5000, r"knobs\.lm_head_chunks: .* \[1, 4096\]"),
    ("hardware", "num_gpus", 2**21, r"hardware\.num_gpus"),
    ("hardware", "gpus_per_node", 2, r"hardware\.gpus_per_node: 2 is outside the allowed range \[1, 1\]"),
    ("knobs", "a\nb", 1, r"knobs\['a\\nb'\]: unknown key"),
])
def test_impossible_values_name_the_field_and_range(section, key, value, match):
    plan = copy.deepcopy(base_plans()[0])
    plan[section][key] = value
    with pytest.raises(UserError, match=match):
        plan_from_dict(plan)


def test_predicted_must_hold_every_category():
    plan = copy.deepcopy(base_plans()[1])
    del plan["predicted"]["host_memory_bytes"]["workspace"]
    with pytest.raises(UserError, match="predicted.host_memory_bytes: must have exactly the keys"):
        plan_from_dict(plan)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_goes_through_the_plan_loader(name):
    """The bounds are checked when fastml.spec builds its presets; here each goes through plan.json and the
    loader's conversions (JSON numbers, the nested rope_scaling) and comes back the same."""
    plan = Plan(model=PRESETS[name], training=Training(global_batch_tokens=256))
    assert plan_from_dict(json.loads(plan.to_json())).model == PRESETS[name]


@pytest.mark.parametrize("config, match", [
    ([1, 2], "expected a JSON object, got list"),
    ({"model_type": ["llama"]}, "model_type \\['llama'\\] is not supported"),
    ({"model_type": "llama", "num_attention_heads": "32", "hidden_size": 4096}, "num_attention_heads: expected int"),
    ({"model_type": "llama", "num_attention_heads": 0, "hidden_size": 4096}, "num_attention_heads: 0 is outside"),
    ({"model_type": "llama", "num_attention_heads": 32, "hidden_size": 4096, "num_hidden_layers": 32,
      "intermediate_size": 11008, "vocab_size": 32000, "rope_scaling": "big"}, "rope_scaling must be an object"),
    ({"model_type": "llama", "num_attention_heads": 32, "hidden_size": 4096, "num_hidden_layers": 32,
      "intermediate_size": 11008, "vocab_size": 32000, "rope_scaling": {"rope_type": "llama3", "factor": "x"}},
     "factor: expected float"),
    ({"model_type": "llama", "num_attention_heads": 32, "hidden_size": 4096, "num_hidden_layers": 10**6,
      "intermediate_size": 11008, "vocab_size": 32000}, r"config\.json: model\.num_layers: 1000000 is outside"),
])
def test_bad_hf_configs_are_user_errors(tmp_path, config, match):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=match):
        resolve_model(str(tmp_path))


def test_unreadable_hf_configs_are_user_errors(tmp_path):
    for content in (b"[" * 100000, b"\xff\xfe", b"{"):
        (tmp_path / "config.json").write_bytes(content)
        with pytest.raises(UserError, match=r"config\.json"):
            resolve_model(str(tmp_path))


# ---------------------------------------------------------------------------------------------------- data


@pytest.fixture
def byte_dataset(tmp_path) -> Path:
    """A byte-tokenized dataset (vocab 257) of 4000 tokens."""
    (tmp_path / "doc.txt").write_text("fastml " * 571)
    prepare([str(tmp_path / "doc.txt")], tmp_path / "data", progress=False)
    return tmp_path / "data"


def test_token_ids_beyond_the_vocab_are_refused_with_their_position(byte_dataset):
    tokens = np.memmap(byte_dataset / TOKENS_FILE, dtype="<u2", mode="r+")
    tokens[1234] = 300
    tokens.flush()
    data = TokenData.open(byte_dataset, seq_len=16, vocab_size=257)
    batches = data.batches(batch_size=8, seed=0)
    with pytest.raises(UserError, match=rf"data {byte_dataset}: token id 300 at position 1234 of tokens\.bin is "
                                        r"beyond the model's vocabulary of 257"):
        for _ in range(data.num_windows // 8 + 1):
            next(batches)


def test_damaged_datasets_are_user_errors(byte_dataset):
    header = json.loads((byte_dataset / "header.json").read_text())
    (byte_dataset / TOKENS_FILE).write_bytes(b"")
    (byte_dataset / "header.json").write_text(json.dumps(header | {"num_tokens": 0}))
    with pytest.raises(UserError, match="has 0 tokens but one sequence"):
        TokenData.open(byte_dataset, seq_len=16, vocab_size=257)
    for text in ("{not json", "[" * 100000, "\udcff"):
        (byte_dataset / "header.json").write_text(text, encoding="utf-8", errors="surrogateescape")
        with pytest.raises(UserError, match="header.json is not readable JSON"):
            TokenData.open(byte_dataset, seq_len=16, vocab_size=257)


@pytest.mark.parametrize("content, match", [
    (b"\x00garbage", "not a valid tokenizer.json"),
    (b"[]", "not a valid tokenizer.json"),
    (json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {}, "unk_token": "<unk>"}}).encode(),
     "has an empty vocabulary"),
])
def test_bad_tokenizer_files_are_user_errors(tmp_path, content, match):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(UserError, match=match):
        HFTokenizer(tmp_path / "tokenizer.json")


# ---------------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("argv, option", [
    (["run", "PLAN", "--steps", "0"], "--steps"),
    (["run", "PLAN", "--steps", "-3"], "--steps"),
    (["plan", "--seq", "0"], "--seq"),
    (["plan", "--global-batch-tokens", "7"], "--global-batch-tokens"),
    (["plan", "--gpu-mem", "lots"], "--gpu-mem"),
    (["plan", "--hw", "nonexistent"], "--hw"),
    (["plan", "--hw", "h200,nonexistent"], "--hw"),
    (["plan", "--trials", "0"], "--trials"),
    (["plan", "--gpus", "0"], "--gpus"),
    (["plan", "--nodes", "0"], "--nodes"),
    (["plan", "--host-mem", "0GiB"], "--host-mem"),
    (["plan", "--study", "/nonexistent/dir/study.db"], "--study"),
    (["run", "PLAN", "--checkpoint-interval", "-1"], "--checkpoint-interval"),
])
def test_bad_cli_values_are_one_line_naming_the_option(tmp_path, capsys, argv, option):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(base_plans()[0]))
    argv = [str(plan) if a == "PLAN" else a for a in argv] + (["-o", str(tmp_path / "out.json")]
                                                               if argv[0] == "plan" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"fastml: error: {option}"), err
    assert not (tmp_path / "out.json").exists()


def test_a_plan_without_a_section_says_which_is_missing():
    """REVIEW: a plan without its knobs reported a global batch that does not add up (the default knobs')."""
    for section in ("training", "hardware", "knobs"):
        data = copy.deepcopy(base_plans()[0])
        del data[section]
        with pytest.raises(UserError, match=rf"^{section}: missing: a plan holds model, training, hardware and knobs"):
            plan_from_dict(data)


def test_a_plan_given_to_calibrate_is_named_a_plan(tmp_path, capsys):
    """REVIEW: `fastml calibrate plan.json` said "unknown key model"."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(base_plans()[0]))
    assert main(["calibrate", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err == f"fastml: error: {plan}: is a plan, not a run record: give a run's directory (`fastml run " \
                  "--run-dir`) or the record.json in it\n"


def test_cli_output_in_a_missing_directory_is_one_line(tmp_path, capsys):
    assert main(["plan", "--device", "cpu", "-o", str(tmp_path / "no" / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"fastml: error: -o: {tmp_path}/no/plan.json: the directory {tmp_path}/no does not exist\n", err


@pytest.fixture
def a_record(tmp_path) -> Path:
    from fastml.record import save_record
    from test_calibrate import synthetic_records
    from fastml import hwprofiles

    save_record(synthetic_records(hwprofiles.load("h200"))["run0"], tmp_path / "record.json")
    return tmp_path / "record.json"


@pytest.mark.parametrize("argv", [["plan", "-o", "DIR"], ["plan", "-o", "/proc/plan.json"],
                                  ["explain", "PLAN", "--trace", "DIR"], ["calibrate", "RECORD", "-o", "DIR"],
                                  ["profile", "-o", "DIR"], ["profile", "-o", "/sys/hw.json"]])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys, monkeypatch, a_record, argv):
    """REVIEW 9: `fastml plan -o DIR` ran the whole search first. Each file a command writes at its end is checked
    first (here the work itself would fail the test)."""
    from fastml.hwprofiles import profile as profile_module
    from fastml.planner import calibrate, planner

    def work(*args, **kwargs):
        raise AssertionError("the work started")
    for module, name in ((planner, "make_plan"), (planner, "replan"), (calibrate, "calibrate"),
                         (profile_module, "profile")):
        monkeypatch.setattr(module, name, work)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(base_plans()[1]))
    paths = {"DIR": str(tmp_path), "PLAN": str(plan), "RECORD": str(a_record)}
    assert main([paths.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"fastml: error: {argv[-2]}: "), err
    assert "is a directory" in err or "cannot write it" in err


def a_file(path: Path) -> Path:
    path.write_text("x")
    return path


def a_directory(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


@pytest.mark.parametrize("option, make, match", [
    ("checkpoint_dir", a_file, "--checkpoint-dir: .*out exists and is not a directory"),
    ("checkpoint_dir", lambda p: a_file(p) / "ck", "--checkpoint-dir: .*out/ck: .*out is a file"),
    ("run_dir", a_file, "--run-dir: .*out exists and is not a directory"),
    ("run_dir", lambda p: a_directory(p / "trace.json").parent, "--run-dir: .*trace.json is a directory"),
    ("log_json", lambda p: p / "log.jsonl", "--log-json: .*log.jsonl: the directory .*out does not exist"),
    ("summary_json", a_directory, "--summary-json: .*out is a directory, not a file"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_training(tmp_path, option, make, match):
    """REVIEW: `--checkpoint-dir FILE` trained every step, then failed "File exists"."""
    from fastml.executor.loop.train import train

    plan = Plan(model=PRESETS["tiny"], training=Training(seq_len=32, global_batch_tokens=32, steps=2))
    path = make(tmp_path / "out")
    if option == "checkpoint_dir":
        plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, checkpoint_dir=str(path)))
    outputs = {"log_json": tmp_path / "log.jsonl"} | ({} if option == "checkpoint_dir" else {option: path})
    with pytest.raises(UserError, match=match):
        train(plan, show_progress=False, console=Console(file=io.StringIO()), **outputs)
    assert not (tmp_path / "log.jsonl").exists() or option == "log_json"  # no step was trained


def test_bad_files_through_the_real_cli(tmp_path, byte_dataset):
    """A few bad inputs through `python -m fastml`, in parallel: exit code 2, one stderr line, no traceback."""
    plan = base_plans()[0]
    files = {
        "nested.json": "[" * 100000,
        "nan.json": json.dumps(plan | {"training": plan["training"] | {"lr": math.nan}}),
        "newline-key.json": json.dumps(plan | {"knobs": plan["knobs"] | {"x\ny": 1}}),
        "huge-int.json": json.dumps(plan | {"model": plan["model"] | {"vocab_size": 10**400}}),
        "version.json": json.dumps(plan | {"version": 2}),
        "truncated.json": json.dumps(plan)[:200],
        "bad-data.json": json.dumps(plan | {"training": plan["training"] | {"data": str(byte_dataset)}}),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    np.memmap(byte_dataset / TOKENS_FILE, dtype="<u2", mode="r+")[:] = 600  # beyond tiny's vocabulary of 512
    runs = {name: subprocess.Popen([sys.executable, "-m", "fastml", "run", str(tmp_path / name), "--steps", "1",
                                    "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=tmp_path)
            for name in files}
    errors = {}
    for name, process in runs.items():
        _, errors[name] = process.communicate(timeout=300)
        assert process.returncode == 2, (name, errors[name])
    for name, err in errors.items():
        assert len(err.splitlines()) == 1 and err.startswith("fastml: error: ") and "Traceback" not in err, \
            (name, err)
    assert "token id 600 at position" in errors["bad-data.json"]
    assert "knobs['x\\ny']: unknown key" in errors["newline-key.json"]
