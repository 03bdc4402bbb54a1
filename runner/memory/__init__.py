"""The memory estimate: what one run of the spec holds on each device and in each node's RAM, before it starts.

The model is built on the meta device (shapes, no weights: seconds even for 70B). Notation: P parameters (tied
ones once), N processes, S the size of an FSDP shard group, w the bytes of a parameter as the optimizer updates it
(4 for fp32; 2 under precision.param_dtype=bf16), c the bytes of the compute dtype (2 for bf16/fp16), k the
optimizer's states per parameter (AdamW 2, SGD with momentum 1, SGD without 0), V the vocabulary, t the tokens of
a micro batch (train.micro_batch_size x data.seq_len).

Weights, gradients and optimizer states, per device:

    single, ddp       weights P.w        gradients P.w        states k.P.w          (ddp: + P.w of gradient buckets)
    fsdp              weights P_S.w      gradients P_S.w      states k.P_S.w
                      P_S = sum over parameters of ceil(rows / S) x columns: FSDP2 shards dim 0, padded evenly;
                      S = N (FULL_SHARD, SHARD_GRAD_OP), 1 (NO_SHARD), the group (HYBRID_SHARD*: replicated across)
    deepspeed 0       fp32: as single;   bf16/fp16: weights 2P + 4P (fp32 master), gradients 2P, states 4k.P
    deepspeed 1, 2    weights m.P + 4.P/N (m = 2 in bf16/fp16, else 4), gradients m.P/N, states 4k.P/N
                      (+ the whole gradient of a parameter that straddles the partition's edge, at most 2)
    deepspeed 3       weights m.P/N + m.P_persist + 4.P/N, gradients m.P/N, states 4k.P/N
                      (P_persist: parameters of at most stage3_param_persistence_threshold elements stay whole)

With an adapter (adapter=lora, qlora; runner/memory/parameters.py) P is the T trained adapter parameters (rank x
(in + out) per adapted linear layer) in every formula above, and the weights add the frozen base: all the model's
parameters in the compute dtype c (under qlora the adapted linear weights in NF4, about 0.52 bytes each), whole
under single, ddp and DeepSpeed ZeRO-0..2 (DeepSpeed's module dtype m), sharded 1/S under fsdp (NF4 as NF4) and
1/N under ZeRO-3. Being in c already, the frozen weights get no autocast casts; qlora dequantizes one NF4 weight
at a time. Loading a pretrained base memory-maps its checkpoint in c: each process's RAM holds only the NF4 copies
and the adapters (a random-init base is built in c).

The optim group has no 8-bit optimizer yet; one (bitsandbytes' or torchao's AdamW8bit) would hold 2 bytes of states
per parameter plus a scale per block instead of AdamW's 8.

Offload moves to CPU RAM: fsdp offload_params the sharded weights, gradients and states ((2 + k).P_S.w per
process); deepspeed offload_optimizer the fp32 master, its gradients and the states ((8 + 4k).P/N), offload_param
the ZeRO-3 weight partitions (m.P/N).

Activations: see runner/memory/activations.py.

Transient buffers: the loss gradient, t x 8V at the start of backward; autocast's cached casts of the linear
weights (c per parameter) under single and ddp; FSDP's all-gathered units in the compute dtype (the root unit,
which FSDP2 keeps gathered from forward to backward, plus 2 + prefetch times the largest unit; SHARD_GRAD_OP keeps
every unit gathered until backward) and a reduce-scatter of a unit (compute + reduce dtype); DeepSpeed's reduce
bucket (reduce_bucket_size elements, twice with overlap_comm), ZeRO-3's live parameters (the largest module plus
stage3_prefetch_bucket_size, at most stage3_max_live_parameters), and the stage-0/1 full gradients before their
reduction; the optimizer step's temporaries (torch's foreach AdamW: one state's size; DeepSpeed: the partition's
fp32 gradients too).

The peak per device is the largest of the phases: weights + states + kept buffers, plus activations + transients at
the start of backward (+ gradients when accumulating), or gradients + transients at its end, or gradients + step
temporaries; and, for DeepSpeed, which moves the whole module onto each device before partitioning it, m.P while
loading. Each node's RAM holds what offload moves there, and while loading, the fp32 model each process builds.

Where each part is: model_shapes.py (the model, from the meta device), parameters.py (what trains, what is frozen
and in what dtype), activations.py, breakdown.py (the parts of an estimate, its phases and peak), replicated.py
(whole copies, single and ddp), each strategy's own terms in its backend (runner/strategies/<name>.py, or
<name>_memory.py beside it), advice.py (the fit check and the cheapest changes that fit), report.py (what `run
task=estimate` prints) and accelerate_view.py (accelerate estimate-memory's table).
"""
