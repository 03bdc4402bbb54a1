"""The same training loop written with accelerate's `Accelerator`; FSDP through its FSDP2 plugin. Instruction rows
are padded per micro batch as in hand_loop.py; the prepared loader gives each process its contiguous slice of
every global batch.

    accelerate launch --num_processes 1 bench/peers/accelerate_loop.py --plan plan.json --records steps.jsonl
    accelerate launch --multi_gpu --num_processes 2 bench/peers/accelerate_loop.py ... --strategy fsdp
"""

import functools

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType
from shared import StepLog, arguments, evaluate_first, initial_model, padded, token_rows, unsupported
from torch.utils.data import DataLoader
from transformers import get_cosine_with_min_lr_schedule_with_warmup


def main() -> None:
    args, plan = arguments()

    fsdp = (
        FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=True,
        )
        if args.strategy == "fsdp"
        else None
    )
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=fsdp)
    if args.strategy == "fsdp" and accelerator.distributed_type is not DistributedType.FSDP:
        unsupported(f"accelerate runs FSDP on accelerators only; here it would run {accelerator.distributed_type}")

    model = initial_model(plan)  # the runner's initial weights
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": plan["weight_decay"]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=plan["lr"],
        betas=plan["betas"],
        eps=plan["eps"],
    )
    # The prepared scheduler steps once per process at each optimizer step, so its lengths count all processes.
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=plan["warmup_steps"] * accelerator.num_processes,
        num_training_steps=plan["max_steps"] * accelerator.num_processes,
        min_lr_rate=plan["min_lr_ratio"],
    )
    rows, eval_rows = token_rows(plan)
    instruction = isinstance(rows, list)  # examples of their own lengths, else text blocks of seq_len tokens
    collate = functools.partial(padded, pad_token_id=plan["pad_token_id"]) if instruction else None
    loader = DataLoader(rows, batch_size=plan["micro_batch_size"], collate_fn=collate)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)

    log = StepLog(args.records)
    evaluate_first(model, eval_rows, plan["micro_batch_size"], accelerator.device, log)
    window = torch.zeros((), device=accelerator.device)
    tokens = torch.zeros((), device=accelerator.device)  # the real tokens since the last log
    tokens_seen = 0
    since_log = 0
    model.train()
    for step, batch in enumerate(loader, start=1):
        if instruction:
            loss = model(**batch).loss
            tokens += batch["attention_mask"].sum()
        else:
            loss = model(input_ids=batch, labels=batch).loss
            tokens += batch.numel()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), plan["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()

        window += loss.detach()
        since_log += 1
        if step % plan["log_every"] == 0 or step == plan["max_steps"]:
            tokens_seen += int(accelerator.reduce(tokens, "sum").item())
            log.record(step, loss=accelerator.reduce(window, "mean").item() / since_log, tokens=tokens_seen)
            window.zero_()
            tokens.zero_()
            since_log = 0
        if step == plan["max_steps"]:
            break

    if accelerator.is_main_process:
        log.save()
    accelerator.end_training()


if __name__ == "__main__":
    main()
