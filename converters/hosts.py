"""Which hosts an http(s) source may be fetched from.

A conversion Job runs inside the cluster, so a source URI must not become a way to reach the cloud's
metadata service (169.254.169.254), the API server or another pod. Two settings, read from the environment:

  MODELFLEET_SOURCE_ALLOW_HOSTS   default: unset (any host the rule below lets through). When set, a
      comma-separated list of host names, IP addresses and CIDR networks: only a URL whose host is listed by
      name, or whose every address lies in a listed address or network, is fetched, private or not (this is
      how an in-cluster mirror is allowed).
  MODELFLEET_SOURCE_DENY_PRIVATE  default: true. With no allow list, a host is refused when any address it
      resolves to is loopback, private (RFC 1918, fc00::/7), link-local (169.254.0.0/16, fe80::/10),
      unspecified, multicast or otherwise not global. `false` turns the rule off (not advised in a cluster).

The host is resolved once and every address checked; the connection then goes to the checked address (the
name still travels in the Host header and as the TLS server name), so a second DNS answer cannot swap in
another address. Redirects are followed one hop at a time, each hop checked the same way (download.py).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from modelfleet.converters.errors import BadInputError, ConversionError

ALLOW_ENV = "MODELFLEET_SOURCE_ALLOW_HOSTS"
DENY_PRIVATE_ENV = "MODELFLEET_SOURCE_DENY_PRIVATE"
_HOSTNAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class HostPolicy:
    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()
    deny_private: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HostPolicy:
        env = os.environ if env is None else env
        names, networks = set(), []
        for raw in env.get(ALLOW_ENV, "").split(","):
            entry = raw.strip().lower().rstrip(".")
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if not _HOSTNAME.fullmatch(entry):
                    raise BadInputError(
                        f"{ALLOW_ENV} entry {raw.strip()!r} is not a host name, IP address or CIDR network"
                    ) from None
                names.add(entry)
        deny = env.get(DENY_PRIVATE_ENV, "true").strip().lower()
        if deny not in _BOOLS:
            raise BadInputError(f"{DENY_PRIVATE_ENV}={deny!r}: use true or false")
        return cls(frozenset(names), tuple(networks), _BOOLS[deny])

    def address(self, url: httpx.URL) -> str:
        """The checked IP address to connect to for `url`; BadInputError naming the host otherwise."""
        if url.scheme not in ("http", "https") or not url.host:
            raise BadInputError(f"source URL {url} is not an http(s) URL with a host")
        host = url.host.lower().rstrip(".")
        addresses = resolve(host, url.port or (443 if url.scheme == "https" else 80))
        if self.names or self.networks:
            if host in self.names:
                return str(addresses[0])
            for address in addresses:
                if not any(address in network for network in self.networks):
                    raise BadInputError(
                        f"source host {host} ({address}) is not in {ALLOW_ENV}; add it there to fetch from it"
                    )
        elif self.deny_private:
            for address in addresses:
                if kind := non_public(address):
                    raise BadInputError(
                        f"source host {host} resolves to {address}, a {kind} address: refused "
                        f"({DENY_PRIVATE_ENV} is on); list the host in {ALLOW_ENV} to fetch from it"
                    )
        return str(addresses[0])


def resolve(host: str, port: int) -> list[Address]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # DNS may be down for a moment: exit 1, which is retried
        raise ConversionError(f"source host {host} cannot be resolved: {exc}") from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))
    if not addresses:
        raise BadInputError(f"source host {host} has no address")
    return addresses


def non_public(address: Address) -> str | None:
    """What kind of non-public address this is, or None for a global one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    for kind in ("unspecified", "loopback", "link_local", "private", "multicast", "reserved"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if address.is_global else "non-global"


def pinned_request(
    client: httpx.Client, url: str, headers: dict[str, str], policy: HostPolicy
) -> httpx.Request:
    """A GET of `url` sent to the address `policy` checked, with the host name in Host and TLS SNI."""
    parsed = httpx.URL(url)
    address = policy.address(parsed)
    extensions = {"sni_hostname": parsed.host} if parsed.scheme == "https" else {}
    host_header = parsed.netloc.decode("ascii")
    return client.build_request(
        "GET", parsed.copy_with(host=address), headers={**headers, "Host": host_header}, extensions=extensions
    )
