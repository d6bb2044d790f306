"""The trainer's machinery: what train_gpt.py runs on, each module's docstring saying what it
holds (docs/README.md lists them)."""
