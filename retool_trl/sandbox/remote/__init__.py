"""Remote backend: runs in the trainer and sends each cell to a code-execution service over HTTP (`client.py`:
`RemoteSandbox`; `service.py`: the service's API), with the program that runs the cell there (`driver.py`).

The driver runs on the service's machine under the service's limits; it is built from stdlib source only and splices
in the jail side's `cell_io.py`. May import `..base` and httpx; never `..host` or `..server`.
"""

from .client import RemoteSandbox, RemoteSession

__all__ = ["RemoteSandbox", "RemoteSession"]
