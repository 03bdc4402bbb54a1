"""The `task` group's options, by name: conf/task/<name>.yaml is runner/tasks/<name>.py's schema."""

from runner.tasks.dpo import DPOTask
from runner.tasks.estimate import EstimateTask
from runner.tasks.evaluate import EvaluateTask
from runner.tasks.generate import GenerateTask
from runner.tasks.grpo import GRPOTask
from runner.tasks.train import TrainTask

TASKS = {
    "train": TrainTask,
    "estimate": EstimateTask,
    "evaluate": EvaluateTask,
    "generate": GenerateTask,
    "dpo": DPOTask,
    "grpo": GRPOTask,
}
