"""The model the tests train where its size is not the point: the tiny preset (same name, vocabulary and layout)
cut to 2 layers of width 64. On a 2-core CPU the tiny preset's bf16 backward matmuls take about 5 s for 3 steps,
this model's a quarter second: the suite stays within its 10 minutes. Tests of the tiny preset itself (its pinned
losses, the main job's default plan) keep the preset."""

import dataclasses

from fastml.spec import PRESETS

SIZES = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128)
SMALL = dataclasses.replace(PRESETS["tiny"], **SIZES)
EVAL_TOKENS = 1024
"""A test run's final evaluation (training.eval_tokens): the default 16,384 tokens took this model 0.5 s on the 2-core
CPU (the tiny preset's 1.6 s), longer than a test run's steps."""
SMALL_OVERRIDES = [*(f"model.{name}={value}" for name, value in SIZES.items()), f"training.eval_tokens={EVAL_TOKENS}"]
"""`--set` pins (`fastml plan`, `make_plan(overrides=...)`) that make a plan's model SMALL, and its evaluation short."""
