"""Jail side: the code that runs inside the sandbox, as the zygote (`worker.py`, which ends its jails through
`ending.py`) and the session processes that run untrusted cells, with none of the trainer's privileges; a cell can
reach everything in this folder.

Stdlib only, and nothing from outside this folder: the zygote runs `worker.py` as a script (`python -I`) and loads
its siblings by path. The host may import the shared pieces (`wire`, `freezer`, `landlock`) but never the reverse.
"""
