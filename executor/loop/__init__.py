"""The training loop (train.py): the model a plan trains (build.py), one optimizer step (step.py), the device and its
memory cap (device.py), what a step measures (meter.py) and shows (display.py), what a run writes (outputs.py), how it
stops on a signal (signals.py), and the faults the reliability tests inject (faults.py)."""
