"""What the tests share; each module of tests/ imports what it uses, and tests/conftest.py the forkserver's.

specs.py        the overrides of a quick run, and its spec composed or validated
command.py      the `run` command as a user types it, each run forked from the warm forkserver
warm.py         that forkserver, its imports made once
runs.py         what a run leaves and does: its run directories and metrics, waiting for it, kill and resume
workers.py      groups of gloo worker processes
host_reads.py   counting the reads that make the host wait for the device
frozen_heap.py  the forkserver's imports taken out of the garbage collector's passes
slurm.py        a real SLURM cluster on this host
data/           the tests' input files: public datasets and config files, their origins in their SOURCE.md
"""

from pathlib import Path

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
