"""The model and its ops: the plain Llama-family transformer (transformer.py), the fused SwiGLU (fused.py), fp8
linears (fp8.py), linears whose weight gradients come a pass later (deferred.py), and the passes that turn a plan's
knobs into changes of the model (apply.py)."""
