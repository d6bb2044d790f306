"""The tools that use a checkpoint: evaluate.py (its validation again, sampling) and
downstream.py (lm-evaluation-harness tasks)."""
