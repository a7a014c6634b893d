"""What is read and written: training checkpoints (checkpoints.py) in fastml's checksummed tensor directories
(tensordir.py, atomic files: files.py), HF import and export (hf.py), token datasets made by `fastml prepare`
(prepare.py) and read for training (data.py)."""
