"""fastml: plans memory- and communication-efficient LLM training for the GPUs you have, and runs the plan.

`fastml.plan` and `fastml.spec` are the contract between `fastml.planner` and `fastml.executor`.
"""

__version__ = "0.1.0"
