"""Launching and process control: the workers' launch (torchrun's elastic agent), SLURM jobs, signals and the
stop vote, build locks and the stall watch."""
