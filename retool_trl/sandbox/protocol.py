"""Host side of the wire format shared with `worker.py`: a 4-byte big-endian length, then UTF-8 JSON.

`worker.py` runs as a standalone script inside the sandbox and cannot import this module, so it carries its own
twin of these few lines; JSON (never pickle) because replies come from untrusted processes.
"""

from __future__ import annotations

import json
import socket
import struct

HEADER = struct.Struct("!I")
CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return HEADER.pack(len(data)) + data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the sandbox closed its socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket):
    (size,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    return json.loads(recv_exact(sock, size))
