"""Triton Inference Server: the Python-backend model (model.py) and its repository writer (repo.py)."""
