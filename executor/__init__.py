"""fastml.executor: runs a plan for real training. It reads plan.json and never imports the planner.

Its entry points are imported on first use, so that reading a dataset's header (as the planner does) does not import
torch."""

__all__ = ["load_pretrained", "train"]


def __getattr__(name: str):
    if name == "load_pretrained":
        from fastml.executor.storage.hf import load_pretrained
        return load_pretrained
    if name == "train":
        from fastml.executor.loop.train import train
        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
