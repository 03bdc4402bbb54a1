"""Imported last of WARM_IMPORTS (warm.py), by the tests' forkserver and by each pytest process: what was imported
before it is left out of the garbage collector's passes from then on (gc.freeze), in that process and in every
process forked from it. A full pass over the objects torch, transformers and DeepSpeed make took 0.2 s, and the
tests' own objects start dozens of them; DeepSpeed's ZeRO-3 also starts one in each rank as it starts."""

import gc

gc.collect()
gc.freeze()
