"""Where tensors live: the optimizer and its states (optim.py; the C++ CPU AdamW, cpu_adam.py), weights, gradients
and block inputs kept in host memory and streamed (offload.py), pinned host buffers (pinned.py)."""
