"""The same training with the transformers `Trainer`; FSDP through its `fsdp` arguments (FSDP2).

Instruction rows go through the collator one would pick for them: `DataCollatorForSeq2Seq`, which pads each micro
batch to its longest row and the labels with -100 (the Trainer's own default collator pads no labels), or with
`--collator flattening` transformers' padding-free `DataCollatorWithFlattening`, which concatenates the micro
batch's examples into one row with position_ids restarting at each (no attention mask: the model finds the
examples from the position_ids and keeps each to itself).

    python bench/peers/trainer_loop.py --plan plan.json --records steps.jsonl
    torchrun --standalone --nproc_per_node 2 bench/peers/trainer_loop.py ... --strategy fsdp
"""

import tempfile

import torch
from shared import StepLog, arguments, initial_model, real_tokens, token_rows, unsupported
from torch.utils.data import Dataset
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments


class CausalLMRows(Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class InstructionRows(Dataset):
    def __init__(self, rows: list[tuple]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids, labels = self.rows[i]
        return {"input_ids": ids.tolist(), "labels": labels.tolist()}


class LogTimes(TrainerCallback):
    """The Trainer's logged loss with its time, and the real tokens of the steps done: it takes the global batches
    in order (a sequential sampler, each process its contiguous slice), so they are the first `step` batches'."""

    def __init__(self, log: StepLog, rows, global_batch: int):
        self.log, self.rows, self.global_batch = log, rows, global_batch

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            step = state.global_step
            self.log.record(step, loss=logs["loss"], tokens=real_tokens(self.rows[: step * self.global_batch]))


def main() -> None:
    args, plan = arguments()

    model = initial_model(plan)  # the runner's initial weights
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            max_steps=plan["max_steps"],
            per_device_train_batch_size=plan["micro_batch_size"],
            learning_rate=plan["lr"],
            weight_decay=plan["weight_decay"],
            adam_beta1=plan["betas"][0],
            adam_beta2=plan["betas"][1],
            adam_epsilon=plan["eps"],
            max_grad_norm=plan["max_grad_norm"],
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": plan["min_lr_ratio"]},
            warmup_steps=plan["warmup_steps"],
            train_sampling_strategy="sequential",
            logging_steps=plan["log_every"],
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=plan["seed"],
            use_cpu=not torch.cuda.is_available(),
            ddp_find_unused_parameters=False,
            **(fsdp if args.strategy == "fsdp" else {}),
        )
        log = StepLog(args.records)
        rows = token_rows(plan)[0]
        if isinstance(rows, list):  # instruction examples of their own lengths
            from runner.components.modeling import byte_tokenizer

            dataset = InstructionRows(rows)
            collator = (
                DataCollatorWithFlattening()
                if args.collator == "flattening"
                else DataCollatorForSeq2Seq(byte_tokenizer(), label_pad_token_id=-100)
            )
        else:
            dataset, collator = CausalLMRows(rows), None
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=dataset,
            data_collator=collator,
            callbacks=[LogTimes(log, rows, plan["global_batch"])],
        )
        if args.strategy == "fsdp" and not trainer.is_fsdp_enabled:
            unsupported(
                f"the Trainer runs FSDP on accelerators only; here it would run {trainer.accelerator.distributed_type}"
            )
        trainer.train()
        if trainer.is_world_process_zero():
            log.save()


if __name__ == "__main__":
    main()
