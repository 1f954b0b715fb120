"""The wire format between the host and the zygote: a 4-byte big-endian length, then UTF-8 JSON (never pickle:
statuses come from untrusted processes). Stdlib-only, on the jail side so that both sides import the same file: the
zygote and session processes as a sibling script module, the host as `retool_trl.sandbox.jail.wire`.
"""

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


def take_frames(buffer: bytearray, max_bytes: int) -> list:
    """Pops complete frames off a buffer; raises ValueError on an oversized or malformed one."""
    frames = []
    while len(buffer) >= HEADER.size:
        (size,) = HEADER.unpack_from(buffer)
        if size > max_bytes:
            raise ValueError(f"a frame of {size} bytes")
        if len(buffer) < HEADER.size + size:
            break
        frames.append(json.loads(bytes(buffer[HEADER.size : HEADER.size + size])))
        del buffer[: HEADER.size + size]
    return frames
