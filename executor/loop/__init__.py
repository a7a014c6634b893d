"""The training loop (train.py): one optimizer step (step.py), the device and its memory cap (device.py), what a
step measures (meter.py) and shows (display.py), and the faults the reliability tests inject (faults.py)."""
