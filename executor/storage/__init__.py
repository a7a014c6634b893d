"""What is read and written: training checkpoints (checkpoints.py) in fastml's checksummed tensor directories
(tensordir.py, atomic files: files.py), HF import and export (hf.py), and the token data (data.py)."""
