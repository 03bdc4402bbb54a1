"""Parallel layouts: how the processes divide a job (dims.py) and how a model is split across them beyond data
parallelism (tensor.py). The strategies (runner/strategies/) place models on these layouts."""
