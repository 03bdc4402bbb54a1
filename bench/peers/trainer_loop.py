"""The same training with the transformers `Trainer`; FSDP through its `fsdp` arguments (FSDP2).

    python bench/peers/trainer_loop.py --plan plan.json --records steps.jsonl
    torchrun --standalone --nproc_per_node 2 bench/peers/trainer_loop.py ... --strategy fsdp
"""

import tempfile

import torch
from torch.utils.data import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from shared import StepLog, arguments, token_rows, unsupported


class CausalLMRows(Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class LogTimes(TrainerCallback):
    def __init__(self, log: StepLog):
        self.log = log

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.log.record(state.global_step, loss=logs["loss"])


def main() -> None:
    args, plan = arguments()

    torch.manual_seed(plan["seed"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(plan["model_config"]), dtype=torch.float32)
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
        trainer = Trainer(model=model, args=training, train_dataset=CausalLMRows(token_rows(plan)[0]),
                          callbacks=[LogTimes(log)])
        if args.strategy == "fsdp" and not trainer.is_fsdp_enabled:
            unsupported(f"the Trainer runs FSDP on accelerators only; here it would run "
                        f"{trainer.accelerator.distributed_type}")
        trainer.train()
        if trainer.is_world_process_zero():
            log.save()


if __name__ == "__main__":
    main()
