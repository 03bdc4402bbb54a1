"""The data stages, a module each: read (runner/data/read.py) → tokenize (tokenize.py) → pack (pack.py) → store
(store.py, rows.py) → batches (batches.py); splits.py composes them into a spec's train and eval rows."""
