"""Host side of the local sandbox: runs in the trainer's process, with the trainer's privileges, and talks to the
zygote and its jails over pipes and sockets (admission, batching, channels, parking, sweeps, cgroups, node shares).

May import the standard library, `..base`, `..isolation` and the shared pieces of `..jail`; never `..server` (the
HTTP service builds on this side, not the other way round).
"""
