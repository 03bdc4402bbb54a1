"""What the tests share; each module of tests/ imports what it uses, and tests/conftest.py the forkserver's.

    helpers.py      the `run` command as a user types it, the run directories it writes, specs, groups of worker
                    processes, and waiting for what a run does, each process forked from a warm forkserver
    host_reads.py   counting the reads that make the host wait for the device
    frozen_heap.py  the forkserver's imports taken out of the garbage collector's passes
    slurm.py        a real SLURM cluster on this host
    data/           the tests' input files: public datasets and config files, their origins in their SOURCE.md
"""

from pathlib import Path

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
