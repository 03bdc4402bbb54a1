"""The files the runner writes and reads: where they are, how they are written whole, tensors, checkpoints'
directories, and what a refused write says."""
