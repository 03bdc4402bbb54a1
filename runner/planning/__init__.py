"""Planning a run before it starts: its time, GPU-hours and cost (runner/planning/time_plan.py), from its FLOPs and
the FLOP rate the hardware reaches, as the user's own past runs measured it, else as the runner's table of measured
figures says, else a stated default."""
