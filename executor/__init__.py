"""fastml.executor: runs a plan for real training. It reads plan.json and never imports the planner."""

from fastml.executor.storage.hf import load_pretrained
from fastml.executor.loop.train import train

__all__ = ["load_pretrained", "train"]
