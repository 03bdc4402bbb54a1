"""Pipeline parallelism's training parts: the layout (schedules, stage bounds), the stages cut from a model, and
the schedule that trains them."""
