"""What the spec's groups build at run time, one module per component (torchtitan's components/): the model and
tokenizer, LoRA/QLoRA, mixed precision, float8, the optimizer, the LR schedule and the trackers. runner/config/ holds
their schemas and checks."""
