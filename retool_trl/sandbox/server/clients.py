"""Who a request comes from, for the server's per-client bounds (sessions, limit sets): its tenant where the server
has per-tenant tokens (`--tokens-file`), else its peer address, with every loopback address one client and an IPv6
client its /64 (one machine may use any address of either for free, so each address a bound of its own would let
one machine take them all; hosts that share a /64, as on many cloud subnets, are then one client: give them
`--tokens-file`). Also reads the tokens file."""

from __future__ import annotations

import ipaddress
import os
import stat

__all__ = ["LOOPBACK", "TokensFileError", "address_key", "read_tokens_file", "tenant_key"]

LOOPBACK = "loopback"  # the one client every 127.0.0.0/8 and ::1 peer is


class TokensFileError(ValueError):
    """A tokens file that cannot be used: one line naming the file, the place and the fix."""


def tenant_key(tenant: str) -> str:
    return f"tenant:{tenant}"


def address_key(host: str | None) -> str:
    """The client a peer address counts as: loopback (any of 127.0.0.0/8 and ::1) is one client, an IPv6 address
    counts as its /64 (a host is usually given a whole /64 and may pick any address in it), IPv4 as itself."""
    if not host:
        return "?"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (`fe80::1%eth0`) names no other host
    except ValueError:
        return host  # not an IP address (a UNIX socket's peer): as it is
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # an IPv4 peer on a dual-stack socket is the same IPv4 client
    if address.is_loopback:
        return LOOPBACK
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return str(address)


def read_tokens_file(path: str) -> dict[str, str]:
    """The `token -> tenant` map of a tokens file: one `TOKEN TENANT` pair per line (separated by blanks), blank
    lines and lines starting with `#` ignored.

    Raises:
        `TokensFileError`: the file cannot be read, other users may read it (its tokens would be theirs, and on the
            `landlock` and `none` levels cells read files of the server's host too), or a line is not one pair, or a
            token appears twice.
    """
    try:
        with open(path) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise TokensFileError(f"cannot read --tokens-file {path}: {error}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokensFileError(
            f"--tokens-file {path} may be read by other users (mode {stat.S_IMODE(mode):o}): chmod 600 {path}"
        )
    tokens: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 2:
            raise TokensFileError(
                f"--tokens-file {path} line {number}: write one 'TOKEN TENANT' pair per line, got {len(fields)} "
                "field(s)"
            )
        token, tenant = fields
        if token in tokens:
            raise TokensFileError(f"--tokens-file {path} line {number}: a token given twice; give each tenant its own")
        tokens[token] = tenant
    if not tokens:
        raise TokensFileError(f"--tokens-file {path} holds no 'TOKEN TENANT' line")
    return tokens
