"""An out-of-memory error told in one line: what the rank that ran out recorded (where the loop was, the device's
allocated and reserved bytes against its own; runner/engine/out_of_memory.py), with the memory estimate's peak for
the run and the cheapest changes that the estimate says need less. The rank records first, in a file beside the
run's logs, so that the launcher can tell it even when the other ranks' errors end the job first."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from runner.config.hardware import GIB
from runner.memory.advice import cheapest_fits, proposals
from runner.memory.breakdown import estimate, readable
from runner.memory.model_shapes import facts_of

if TYPE_CHECKING:
    from runner.config.spec import RunSpec

RECORD = "out_of_memory_rank{rank}.json"


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    (run_dir / RECORD.format(rank=record["rank"])).write_text(json.dumps(record))


def take_out_of_memory_record(run_dir: Path) -> Optional[dict[str, Any]]:
    """Removes the ranks' records of an out-of-memory error from the run directory; the first rank's, or None."""
    records = [json.loads(path.read_text()) for path in run_dir.glob(RECORD.format(rank="*"))]
    for path in run_dir.glob(RECORD.format(rank="*")):
        path.unlink()
    return min(records, key=lambda record: record["time"]) if records else None


def out_of_memory_line(record: dict[str, Any], spec: RunSpec) -> str:
    facts = facts_of(spec.model)
    peak = estimate(spec, facts).peak
    return (
        f"rank {record['rank']} ran out of memory {record['where']}: {record['held']}; the estimate's peak for "
        f"this run is {readable(peak)} per device; {cheaper(spec, peak)}{record['summary']}"
    )


def cheaper(spec: RunSpec, peak: int) -> str:
    """The cheapest changes that bring the estimate's peak a tenth lower, as the fit check proposes them."""
    tighter = replace(spec, hardware=replace(spec.hardware, device_memory_gib=0.9 * peak / GIB))
    found = cheapest_fits(tighter, facts_of(spec.model))
    return f"what needs less: {proposals(found)}" if found else "the estimate knows no change that needs less"
