"""lm-evaluation-harness's model interface over a model as the runner placed it (for training under its strategy, or
for task=evaluate): lm-eval owns the tasks, their prompts and metrics, and asks this model for log-likelihoods and
greedy completions.

Each data-parallel rank answers its own shard of the requests (lm-eval's evaluator splits them by `rank` and
`world_size`, the data-parallel ones). Ranks that hold shards of one model (FSDP2, ZeRO-3) must run every forward
together, so each request list is evened out across ranks first, with copies of its first request, whose answers
are dropped. The ranks of a tensor-parallel group run the same requests; the first of each group reports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from runner.distributed import process_group_up
from runner.generation.decoding import Decoding
from runner.generation.rollout import sample

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Shard:
    """This rank's place among the data-parallel ranks, and whether it reports its group's answers."""

    rank: int
    size: int
    counted: bool


# lm-eval's own default for a generation task that does not say (HFLM's max_gen_toks).
DEFAULT_GENERATED = 256


class PlacedModelLM(TemplateLM):
    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        autocast: Callable[[], ContextManager],
        max_length: int,
        batch_size: int,
        shard: Shard,
    ):
        super().__init__()
        self.model, self.tokenizer, self.autocast = model, tokenizer, autocast
        self.max_length, self.batch_size, self.counted = max_length, batch_size, shard.counted
        self._device, self._rank, self._world_size = device, shard.rank, shard.size

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # as lm-eval's HFLM: the context of a continuation scored alone
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        chosen = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **chosen)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Each continuation's summed log-probability given its context, and whether it is the greedy one."""
        import torch

        pairs = self.evened(
            [(context, continuation) for _, context, continuation in requests],
            filler=([self.prefix_token_id], [self.eot_token_id]),
        )
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        answers: dict[int, tuple[float, bool]] = {}
        with torch.no_grad():
            for start in range(0, len(order), self.batch_size):
                chosen = order[start : start + self.batch_size]
                rows = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :][:-1] for i in chosen]
                logps = self.forward_logps(rows)
                for i, row, row_logps in zip(chosen, rows, logps):
                    continuation = pairs[i][1]
                    ends = row_logps[len(row) - len(continuation) : len(row)]
                    targets = torch.tensor(continuation, device=ends.device)
                    picked = ends.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                    answers[i] = (float(picked.sum()), bool((ends.argmax(-1) == targets).all()))
        return [answers[i] for i in range(len(requests))]

    def forward_logps(self, rows: list[list[int]]) -> torch.Tensor:
        """The log-softmax over the vocabulary at every position of the right-padded rows, in fp32."""
        import torch

        length = max(len(row) for row in rows)
        ids = torch.zeros((len(rows), length), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        with self.autocast():
            logits = self.model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device)).logits
        return torch.log_softmax(logits.float(), dim=-1)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over windows of at most max_length tokens, as lm-eval's HFLM counts it."""
        windows: list[tuple[int, list[int], list[int]]] = []
        for index, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1):
                context, continuation = make_disjoint_window(window)
                windows.append((index, context, continuation))
        scored = self._loglikelihood_tokens([(None, context, continuation) for _, context, continuation in windows])
        totals = [0.0] * len(requests)
        for (index, _, _), (logp, _) in zip(windows, scored):
            totals[index] += logp
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy completions, each cut at the first of its task's stop strings."""
        asked = self.evened([request.args for request in requests], filler=("", {"max_gen_toks": 1}))
        texts = []
        for start in range(0, len(asked), self.batch_size):
            batch = asked[start : start + self.batch_size]
            limit = max(kwargs.get("max_gen_toks", DEFAULT_GENERATED) for _, kwargs in batch)
            stops = [_until(kwargs.get("until")) for _, kwargs in batch]
            decoding = Decoding(
                max_new_tokens=limit, eos_token_id=self.eot_token_id, pad_token_id=self.tokenizer.pad_token_id or 0
            )
            contexts = [self.tok_encode(context) or [self.prefix_token_id] for context, _ in batch]

            def stopped(row: int, tokens: list[int]) -> bool:
                return any(stop in self.tokenizer.decode(tokens) for stop in stops[row])

            new_tokens = sample(
                self.model, contexts, [None] * len(contexts), decoding, self._device, self.autocast, stopped
            ).tokens
            for row_stops, tokens in zip(stops, new_tokens):
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                for stop in row_stops:
                    text = text.split(stop)[0]
                texts.append(text)
        return texts[: len(requests)]

    def evened(self, items: list[Any], filler: Any) -> list[Any]:
        """The items, padded with `filler` to as many as the rank with the most has."""
        if not self.synced():
            return items
        return items + [filler] * (self.most(len(items)) - len(items))

    def most(self, count: int) -> int:
        import torch
        import torch.distributed as dist

        counted = torch.tensor([count], device=self._device)
        dist.all_reduce(counted, op=dist.ReduceOp.MAX)
        return int(counted.item())

    def synced(self) -> bool:
        return process_group_up()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.stack([t.to(tensor.device) for t in self.reported(tensor.cpu())])

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        gathered = self.reported(obj)
        return gathered if self.rank == dst else None

    def barrier(self) -> None:
        if self.synced():
            import torch.distributed as dist

            dist.barrier()

    def reported(self, obj: Any) -> list[Any]:
        """Every data-parallel shard's object, in rank order: the first rank's of each tensor-parallel group."""
        if not self.synced():
            return [obj]
        import torch.distributed as dist

        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.counted, obj))
        return [value for counted, value in every if counted]


def _until(until: Any) -> list[str]:
    if until is None:
        return []
    return [until] if isinstance(until, str) else list(until)
