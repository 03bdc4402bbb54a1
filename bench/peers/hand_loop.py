"""A minimal hand-written PyTorch training loop: one process, or DDP / FSDP2 (`fully_shard`) under torchrun.
Instruction rows are padded per micro batch to its longest row, with an attention mask and the labels IGNORE on
the padding; each rank takes its contiguous slice of every global batch, as the runner's ranks do. Where the plan
says so, the forward runs under bf16 autocast ("autocast": "bf16") and each transformer block is compiled
("compile": true), as the runner's precision=bf16 and train.compile=true do.

    python bench/peers/hand_loop.py --plan plan.json --records steps.jsonl
    torchrun --standalone --nproc_per_node 2 bench/peers/hand_loop.py --plan plan.json --records steps.jsonl \
        --strategy fsdp
"""

import contextlib
import functools
import math
import os

import torch
import torch.distributed as dist
from shared import StepLog, arguments, evaluate_first, initial_model, padded, token_rows
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def joined(distributed: bool) -> torch.device:
    """This process's device, in the process group torchrun set up for it."""
    cuda = torch.cuda.is_available()
    if not distributed:
        return torch.device("cuda" if cuda else "cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return device


def placed(model, strategy: str, device):
    model.to(device)
    if strategy == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def main() -> None:
    args, plan = arguments()

    distributed = args.strategy != "single"
    device = joined(distributed)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    model = initial_model(plan)  # the runner's initial weights
    if plan.get("compile"):
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward)
    model = placed(model, args.strategy, device)
    if plan.get("autocast") == "bf16":
        forward_context = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    else:
        forward_context = contextlib.nullcontext
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
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(plan["warmup_steps"], plan["max_steps"], plan["min_lr_ratio"])
    )

    rows, eval_rows = token_rows(plan)
    micro = plan["micro_batch_size"]
    instruction = isinstance(rows, list)  # examples of their own lengths, else text blocks of seq_len tokens
    if instruction:
        mine = [
            i
            for start in range(0, len(rows), plan["global_batch"])
            for i in range(start + rank * micro, start + (rank + 1) * micro)
        ]
        loader = DataLoader(
            rows,
            batch_size=micro,
            sampler=mine,
            collate_fn=functools.partial(padded, pad_token_id=plan["pad_token_id"]),
        )
    else:
        sampler = DistributedSampler(rows, shuffle=False) if distributed else None
        loader = DataLoader(rows, batch_size=micro, sampler=sampler)

    log = StepLog(args.records)
    evaluate_first(model, eval_rows, micro, device, log)
    window = torch.zeros(2, device=device)  # the loss summed over the steps since the last log; the real tokens
    tokens_seen = 0
    since_log = 0
    model.train()
    for step, batch in enumerate(loader, start=1):
        if instruction:
            batch = {name: tensor.to(device) for name, tensor in batch.items()}
            with forward_context():
                loss = model(**batch).loss
            window[1] += batch["attention_mask"].sum()
        else:
            batch = batch.to(device)
            with forward_context():
                loss = model(input_ids=batch, labels=batch).loss
            window[1] += batch.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

        window[0] += loss.detach()
        since_log += 1
        if step % plan["log_every"] == 0 or step == plan["max_steps"]:
            if distributed:
                dist.all_reduce(window)
            tokens_seen += int(window[1].item())
            log.record(step, loss=window[0].item() / world / since_log, tokens=tokens_seen)
            window.zero_()
            since_log = 0
        if step == plan["max_steps"]:
            break

    if distributed:
        dist.barrier()  # both ranks leave together: gloo's teardown hung when one was still logging
        dist.destroy_process_group()
    if rank == 0:
        log.save()


if __name__ == "__main__":
    main()
