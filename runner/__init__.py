"""runner: a declarative experiment runner for PyTorch training, driven by Hydra config groups."""
