"""Where webhooks may be sent: public addresses only, unless an operator allows a host explicitly.

Used twice: when an endpoint is created (a clear 422) and when the dispatcher connects (`worker/webhooks.py`
resolves the host ONCE, checks every address, and connects to a checked address, so a name that changes
its answer between the two (DNS rebinding) is caught where it matters).

Refused: loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7), link-local (169.254/16, fe80::/10,
incl. 169.254.169.254), CGNAT (100.64/10), multicast, unspecified, reserved and documentation ranges,
anything `ipaddress` does not call global, IPv4 embedded in IPv6 (mapped, 6to4, Teredo, NAT64) judged as
that IPv4, metadata and local names (`metadata.google.internal`, `*.internal`, `localhost`, ...), URLs with
userinfo. Hosts are read as the C resolver reads them, so `2130706433`, `0x7f000001`, `0177.0.0.1` and
`127.1` are all 127.0.0.1. `webhook_allow_hosts` (comma separated host names, IP addresses or CIDR
networks, empty by default) lifts the address check for those hosts or networks.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["AllowList", "RefusedAddress", "check_url", "host_of", "is_public", "resolve_checked"]

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_BLOCKED_NAMES = {"localhost", "metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                  "metadata.azure.internal", "kubernetes.default", "kubernetes.default.svc"}
_BLOCKED_SUFFIXES = (".localhost", ".internal", ".local", ".localdomain", ".home.arpa", ".cluster.local")


class RefusedAddress(ValueError):
    """The URL's host is, or resolves to, an address webhooks may not reach."""


@dataclass(frozen=True)
class AllowList:
    """Operator exceptions: exact host names / IP literals, and networks."""

    names: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, text: str | Iterable[str]) -> AllowList:
        items = text.split(",") if isinstance(text, str) else list(text)
        names: set[str] = set()
        nets = []
        for raw in items:
            item = raw.strip().lower().strip("[]").rstrip(".")
            if not item:
                continue
            try:
                nets.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                names.add(item)
        return cls(frozenset(names), tuple(nets))

    def allows_name(self, host: str) -> bool:
        return _norm(host) in self.names

    def allows_ip(self, ip: IP) -> bool:
        return any(ip.version == n.version and ip in n for n in self.networks) or str(ip) in self.names


def _norm(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: IP) -> bool:
    """Whether `ip` is a public unicast address (embedded IPv4 judged as itself)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return False
        inner = _embedded_v4(ip)
        if inner is not None:
            return is_public(inner)
    bad = (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
           or ip.is_unspecified or not ip.is_global)
    return not bad


def _literal(host: str) -> IP | None:
    """The address a host written as a number denotes (every form `inet_aton` accepts), else None."""
    h = _norm(host)
    try:
        return ipaddress.ip_address(h.split("%", 1)[0] if ":" in h else h)
    except ValueError:
        pass
    if h and all(c in "0123456789abcdefx." for c in h) and (h[0].isdigit()):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(h))
        except OSError:
            return None
    return None


def host_of(url: str) -> tuple[str, int]:
    """(host, port) the HTTP client connects to; RefusedAddress for userinfo or an unusable URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RefusedAddress(f"not a valid URL: {exc}") from None
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise RefusedAddress("the URL must not contain credentials (user:password@)")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RefusedAddress("the URL must be http(s) with a host")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _check_name(host: str, allow: AllowList) -> IP | None:
    """Static checks of a host (no DNS); returns its address when it is a literal."""
    if allow.allows_name(host):
        return None
    ip = _literal(host)
    if ip is not None:
        if not is_public(ip) and not allow.allows_ip(ip):
            raise RefusedAddress(f"the host {host!r} is the non-public address {ip}")
        return ip
    name = _norm(host)
    if name in _BLOCKED_NAMES or name.endswith(_BLOCKED_SUFFIXES) or "." not in name:
        raise RefusedAddress(f"the host {host!r} is an internal name (local or metadata address)")
    return None


def resolve_checked(host: str, port: int, allow: AllowList) -> list[IP]:
    """Resolve `host` once (`socket.getaddrinfo`) and return its addresses, all of them checked.

    Raises RefusedAddress when any address is not public (and not allowed), OSError when it does not resolve.
    """
    _check_name(host, allow)
    infos = socket.getaddrinfo(_norm(host), port, type=socket.SOCK_STREAM)
    ips: list[IP] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if ip not in ips:
            ips.append(ip)
    if not allow.allows_name(host):
        for ip in ips:
            if not is_public(ip) and not allow.allows_ip(ip):
                raise RefusedAddress(f"the host {host!r} resolves to the non-public address {ip}")
    if not ips:
        raise OSError(f"{host!r} has no address")
    return ips


def check_url(url: str, allow: AllowList, *, resolve: bool = True) -> None:
    """Creation-time check: userinfo, literal addresses and internal names; with `resolve`, a name that
    resolves must resolve to public addresses only (one that does not resolve yet is accepted: it is
    checked again when a message is sent)."""
    host, port = host_of(url)
    if _check_name(host, allow) is not None or not resolve:
        return
    try:
        resolve_checked(host, port, allow)
    except (OSError, UnicodeError):
        return
