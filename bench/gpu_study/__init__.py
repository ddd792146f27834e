"""The study at real shapes on a GPU (docs in study.py)."""
