"""One engine's egress filter: its links, resolver, proxy and the events they record.

:class:`NetworkManager` starts lazily, at the first sandbox with a policy: the
nftables table (:mod:`.netns`), the resolver (:mod:`.dns`) and the proxy
(:mod:`.proxy`). Each policy sandbox is *attached* (a link of its own) before its
launcher starts and *detached* when it ends. :meth:`NetworkManager.update` swaps a
policy live and resets every relayed connection the new one refuses.

Addresses the proxy never dials, whatever a policy says: the host's own addresses
(its loopback and every interface's: the daemon's API, other services) and the links'
subnets (other sandboxes), IPv4 and IPv6 alike. Names are resolved on the host, through
``hosts`` first (a daemon-side mapping, e.g. for a test's server) and then the host's
resolver, to IPv4 and IPv6 addresses. Allowed UDP (not DNS) goes through the relay
(:mod:`.udp`); what the kernel refused (other UDP, other protocols) is read back from
the table's sets when events are asked for (:func:`.netns.refused`).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import resource
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import SandboxNotFound
from corral.network_schema import PRESETS, NetworkPolicy
from corral.runtime.net import netns
from corral.runtime.net.dns import QTYPE_A, QTYPE_AAAA, Query, Resolver
from corral.runtime.net.policy import Compiled
from corral.runtime.net.private import PrivateNets, private_subnet
from corral.runtime.net.proxy import Conn, Proxy, upstream_proxy
from corral.runtime.net.udp import Flow, UdpRelay
from corral.runtime.threadwork import finish_in_thread

WARM_LINKS = 4  # links made ahead of time (a namespace is ~7 ms of create otherwise)
MAX_EVENTS = 1000  # kept per sandbox, oldest dropped first
MAX_CONNECTIONS = 256  # open at once per sandbox (relayed or being read); more refused
# Every relayed connection or UDP flow holds two of the daemon's descriptors (the
# sandbox's end and the far end's): all of them together take at most a quarter of its
# open-file limit (MAX_RELAYS_SHARE), one tenant's at most half of that, so no
# tenant's sandboxes can leave the daemon (its API, its other sandboxes) without
# descriptors, nor every other tenant without relays.
MAX_RELAYS_SHARE = 8
RESOLVE_TIMEOUT_S = 5.0
# Host lookups (getaddrinfo blocks a thread for as long as a name's servers take, past
# RESOLVE_TIMEOUT_S) run in threads of their own, never the daemon's shared executor,
# and a sandbox has at most LOOKUPS_PER_SANDBOX running at once: a flood of names whose
# servers never answer stalls only that sandbox's lookups.
LOOKUP_THREADS = 16
LOOKUPS_PER_SANDBOX = 4


@dataclass
class Attached:
    sandbox_id: str
    link: netns.Link
    policy: Compiled
    owner: str | None = None  # its tenant (None: the admin's)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    conns: set[Conn] = field(default_factory=set)
    flows: set[Flow] = field(default_factory=set)  # UDP, relayed
    udp: list[tuple[str, str]] = field(default_factory=list)  # the kernel's allow entries
    # their first setting, made while the sandbox starts (settle() waits for it)
    udp_set: Future[None] | None = None
    private_set: Future[None] | None = None  # its place on a private network (the same)
    since: float = field(default_factory=time.time)
    open: int = 0  # connections accepted and not yet closed (relayed or being read)
    lookups: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(LOOKUPS_PER_SANDBOX))

    def record(self, kind: str, verdict: bool, reason: str, *, name: str | None = None,
               ip: str | None = None, port: int | None = None) -> None:
        self.events.append({"time": time.time(), "kind": kind, "name": name, "ip": ip,
                            "port": port, "verdict": "allowed" if verdict else "refused",
                            "reason": reason})


def max_relays() -> int:
    """How many connections and flows the relays hold at once, all sandboxes together:
    a quarter of this process's open-file limit (two descriptors each)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(2 * MAX_CONNECTIONS, soft // MAX_RELAYS_SHARE)


def is_local(ip: str) -> bool:
    """Whether ``ip`` is one of this host's own addresses (binding to it works)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


# the sandbox a task resolves names for (set by the resolver's and the proxy's tasks)
_serving: ContextVar[Attached | None] = ContextVar("corral_net_serving", default=None)


def _ended(loop: asyncio.AbstractEventLoop, gate: asyncio.Semaphore | None,
           thread: Future[object]) -> None:
    """A host lookup's thread is done: its sandbox's place back (on the loop)."""
    if not thread.cancelled():
        thread.exception()  # retrieved: a timed-out lookup's error is nobody's
    if gate is not None and not loop.is_closed():
        loop.call_soon_threadsafe(gate.release)


def _still_allowed(policy: Compiled, conn: Conn) -> bool:
    try:
        ip = ipaddress.ip_address(conn.ip)
    except ValueError:  # a name the host's proxy resolves (and dials)
        return conn.name is not None and policy.name_allowed(conn.name, conn.port)
    return policy.decide(conn.name, ip, conn.port).allowed


class NetworkManager:
    """The egress filter of one engine (``key``: its table's and links' owner)."""

    def __init__(self, key: str, lock_dir: Path, hosts: dict[str, str] | None = None,
                 *, warm: int = WARM_LINKS) -> None:
        self.table = f"corral_{key}"
        self.links = netns.Links(lock_dir)
        self.hosts = {k.lower(): v for k, v in (hosts or {}).items()}
        self._by_ip: dict[str, Attached] = {}
        self._by_id: dict[str, Attached] = {}
        self._resolver = Resolver(self._lookup, self._admit)
        self._nft = ThreadPoolExecutor(2, thread_name_prefix="corral-nft")
        self._lookup_threads = ThreadPoolExecutor(LOOKUP_THREADS,
                                                  thread_name_prefix="corral-resolve")
        self.private = PrivateNets(self.table)  # private networks (private.py)
        self._proxy = Proxy(self._decide, self._admit)
        self._udp = UdpRelay(self._decide_udp, self._admit)
        self._started = False
        self._in_table: set[str] = set()  # host ends of adopted links in the table's set
        self._start_lock = asyncio.Lock()
        self.warm = warm
        self._ready: deque[netns.Link] = deque()
        self._making = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.max_relays = max_relays()  # set again at start (the daemon raises its limit)
        self._relays: Counter[str | None] = Counter()  # open, by owner

    async def _start(self) -> None:
        async with self._start_lock:
            if self._started:
                return
            await asyncio.to_thread(self.links.sweep)  # what a killed daemon left
            await asyncio.to_thread(self.private.sweep)
            six = netns.ipv6_on()
            await self._resolver.start(ipv6=six)
            self.max_relays = max_relays()
            await self._proxy.start(ipv6=six)
            await self._udp.start(ipv6=six)
            handed = [a.link.host_if for a in self._by_id.values()]  # adopted before
            await asyncio.to_thread(netns.create_table, self.table, proxy_port=self._proxy.port,
                                    dns_port=self._resolver.port, udp_port=self._udp.port,
                                    links=handed, lock_dir=self.links.lock_dir)
            self._in_table.update(handed)
            self._started = True

    async def attach(self, sandbox_id: str, policy: NetworkPolicy, owner: str | None = None
                     ) -> netns.Link:
        """A link for ``sandbox_id``, enforcing ``policy``; its namespace is ready, on
        ``owner``'s private network ``policy.join`` if it names one.
        Links are never reused: a warm one is fresh, made ahead of time."""
        await self._start()
        compiled = await self._compile(policy)
        link = self._ready.popleft() if self._ready else await self._make()
        self._refill()
        try:
            if policy.max_mbps is not None:
                await finish_in_thread(lambda: netns.shape(link, policy.max_mbps))
            place = None if policy.join is None else self.private.reserve(
                owner, policy.join, sandbox_id, policy.alias)  # InvalidState now
        except BaseException:
            await finish_in_thread(lambda: self._teardown(link))
            raise
        att = Attached(sandbox_id, link, compiled, owner)
        if place is not None:  # linked to the bridge while the sandbox starts, as UDP's
            att.private_set = self._nft.submit(self.private.plug, *place, link,
                                               policy.max_mbps)
        # the UDP entries go in while the sandbox starts (no code of its runs before
        # READY; the engine settles them then): a create waits for no nft call
        att.udp = compiled.udp_entries()
        att.udp_set = self._nft.submit(netns.set_udp, link, self.table, [], att.udp)
        self._by_ip[link.sandbox_ip] = self._by_ip[link.sandbox_ip6] = att
        self._by_id[sandbox_id] = att
        return link

    async def settle(self, sandbox_id: str) -> None:
        """Wait until the sandbox's UDP entries are in (its first policy's), and its
        place on a private network."""
        att = self._by_id.get(sandbox_id)
        for made in (att.udp_set, att.private_set) if att is not None else ():
            if made is not None:
                await asyncio.wrap_future(made)

    async def _set_udp(self, att: Attached, compiled: Compiled) -> None:
        await self.settle(att.sandbox_id)
        new = compiled.udp_entries()
        await asyncio.to_thread(netns.set_udp, att.link, self.table, att.udp, new)
        att.udp = new

    async def adopt(self, sandbox_id: str, policy: NetworkPolicy, link: netns.Link,
                    owner: str | None = None) -> None:
        """A policy sandbox handed over by the previous engine (live restore): its link
        (namespace, veth, held lock) stays as it is; this engine's table, resolver and
        proxy enforce ``policy`` on it from now on. Its connections relayed by the old
        proxy ended with that daemon, and its event log starts afresh."""
        att = Attached(sandbox_id, link, await self._compile(policy), owner)
        att.udp = att.policy.udp_entries()
        self._by_ip[link.sandbox_ip] = self._by_ip[link.sandbox_ip6] = att
        self._by_id[sandbox_id] = att
        if policy.join is not None:  # before _start, whose sweep keeps only known bridges
            await asyncio.to_thread(self.private.adopt, owner, policy.join, sandbox_id,
                                    policy.alias, link)
        await self._start()
        if link.host_if not in self._in_table:  # adopted after the table was made
            await asyncio.to_thread(netns.add_link, self.table, link)
            self._in_table.add(link.host_if)
        # the new table's UDP sets start empty: its entries again (refused meanwhile)
        await asyncio.to_thread(netns.set_udp, link, self.table, [], att.udp)

    def lock_fd(self, sandbox_id: str) -> int:
        """The descriptor holding ``sandbox_id``'s link (handed to the warden with it)."""
        return self._get(sandbox_id).link.lock_fd

    @staticmethod
    async def _compile(policy: NetworkPolicy) -> Compiled:
        if any(r in PRESETS for r in (*policy.allow, *policy.deny)):
            return await asyncio.to_thread(Compiled.of, policy)  # a preset may ask pip
        return Compiled.of(policy)

    async def _make(self) -> netns.Link:
        # a cancelled create's link is torn down, not left half made: each step ends first
        link = await finish_in_thread(self.links.acquire, on_cancel=self.links.release)
        try:
            await finish_in_thread(lambda: netns.setup(link, self.table))
        except BaseException:
            await finish_in_thread(lambda: self._teardown(link))
            raise
        return link

    def _refill(self) -> None:
        while not self._closed and len(self._ready) + self._making < self.warm:
            self._making += 1
            task = asyncio.get_running_loop().create_task(self._make_warm())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _make_warm(self) -> None:
        try:
            link = await self._make()
        except Exception:  # noqa: BLE001 - a warm link is an optimisation; attach retries
            return
        finally:
            self._making -= 1
        if self._closed:
            await asyncio.to_thread(self._teardown, link)
        else:
            self._ready.append(link)

    def detach(self, sandbox_id: str) -> None:
        """Cut its connections, remove its link (blocking: call it from a thread)."""
        att = self._by_id.pop(sandbox_id, None)
        if att is None:
            return
        self._by_ip.pop(att.link.sandbox_ip, None)
        self._by_ip.pop(att.link.sandbox_ip6, None)
        if att.private_set is not None:
            att.private_set.exception()  # waits: not left before it is plugged
        self.private.leave(sandbox_id)
        try:  # the link's index is reused: its UDP entries go with it
            if att.udp_set is None or att.udp_set.exception() is None:  # waits for it
                netns.set_udp(att.link, self.table, att.udp, [])
        finally:
            self._teardown(att.link)  # its relayed connections: cut_all, on the loop, first

    def cut_all(self, sandbox_id: str) -> None:
        """Reset every connection the sandbox has open through the proxy."""
        att = self._by_id.get(sandbox_id)
        for conn in list(att.conns if att else ()):
            conn.cut()
        for flow in list(att.flows if att else ()):
            flow.cut()

    def _teardown(self, link: netns.Link) -> None:
        try:
            netns.teardown(link, self.table, quiet=True)
        finally:
            self.links.release(link)

    def _get(self, sandbox_id: str) -> Attached:
        att = self._by_id.get(sandbox_id)
        if att is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} has no network policy",
                                  details={"sandbox_id": sandbox_id})
        return att

    def events(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The sandbox's events, the kernel's refusals (UDP, other protocols) among
        them, by time."""
        att = self._get(sandbox_id)
        kernel = [{"name": None, "ip": None, "port": None, "verdict": "refused",
                   "reason": "refused by the kernel: UDP needs an allow rule naming its "
                   "address" if e["kind"] == "udp" else
                   f"protocol {e.get('protocol')} is not relayed (TCP and UDP only)", **e}
                  for e in netns.refused(self.table, att.link.host_if)
                  if float(e["time"]) >= att.since - 1]  # type: ignore[arg-type]
        return sorted([*att.events, *kernel], key=lambda e: e["time"])

    async def update(self, sandbox_id: str, policy: NetworkPolicy) -> int:
        """Enforce ``policy`` from now on; reset the connections it refuses (how many)."""
        att = self._get(sandbox_id)
        if policy.max_mbps != att.policy.policy.max_mbps:
            await asyncio.to_thread(netns.shape, att.link, policy.max_mbps)
            if att.private_set is not None:  # plugged first (while it started)
                await asyncio.to_thread(att.private_set.result)
            # and with the other members of its private network, if it is on one
            await asyncio.to_thread(self.private.shape, sandbox_id, att.link, policy.max_mbps)
        att.policy = await self._compile(policy)
        await self._set_udp(att, att.policy)
        cut = 0
        for flow in list(att.flows):
            if not att.policy.decide_udp(ipaddress.ip_address(flow.ip), flow.port).allowed:
                flow.cut()
                att.record("udp", False, "cut: the new policy refuses it", ip=flow.ip,
                           port=flow.port)
                cut += 1
        for conn in list(att.conns):
            if not _still_allowed(att.policy, conn):
                conn.cut()
                att.record("tcp", False, "cut: the new policy refuses it", name=conn.name,
                           ip=conn.ip, port=conn.port)
                cut += 1
        return cut

    async def close(self, *, keep: Collection[str] = ()) -> None:
        """Tear down every link and the table; those of the sandboxes in ``keep`` (handed
        over to the next engine with their lock, which the warden holds meanwhile) and
        then the table stay, for the next engine to :meth:`adopt`."""
        self._closed = True  # warm links being made are torn down when made
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._ready:
            await asyncio.to_thread(self._teardown, self._ready.popleft())
        kept = 0
        for sid in list(self._by_id):
            if sid in keep:
                att = self._by_id.pop(sid)
                self._by_ip.pop(att.link.sandbox_ip, None)
                self._by_ip.pop(att.link.sandbox_ip6, None)
                self.links.release(att.link)  # our copy: the warden's holds the lock
                kept += 1
                continue
            self.cut_all(sid)
            await asyncio.to_thread(self.detach, sid)
        self._proxy.close()
        self._udp.close()
        self._resolver.close()
        self._lookup_threads.shutdown(wait=False, cancel_futures=True)
        self._nft.shutdown(wait=True)
        if self._started and not kept:
            await asyncio.to_thread(netns.drop_table, self.table, self.links.lock_dir)

    # ------------------------------------------------------------ enforcement

    async def resolve(self, name: str) -> list[str]:
        """IPv4 and IPv6 addresses of ``name``, resolved on the host (``hosts`` first: an
        address, or several separated by commas), in the
        resolver's own threads, at most LOOKUPS_PER_SANDBOX at once for the sandbox
        being served (:data:`_serving`)."""
        if name in self.hosts:
            return self.hosts[name].split(",")
        att = _serving.get()
        gate = att.lookups if att is not None else None
        family = socket.AF_UNSPEC if netns.ipv6_on() else socket.AF_INET
        lookup = functools.partial(socket.getaddrinfo, name, None, family, socket.SOCK_STREAM)
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                if gate is not None:
                    await gate.acquire()
                try:
                    thread = self._lookup_threads.submit(lookup)
                except BaseException:
                    if gate is not None:
                        gate.release()
                    raise
                # the thread's lookup outlives a timeout: its place is given back when
                # it ends, not before
                loop = asyncio.get_running_loop()
                thread.add_done_callback(functools.partial(_ended, loop, gate))
                infos = await asyncio.wrap_future(thread)
        except (OSError, TimeoutError, ValueError, RuntimeError):
            return []  # ValueError: a name IDNA refuses (a label over 63, from a Host)
        return list(dict.fromkeys(str(i[4][0]).split("%")[0] for i in infos))

    async def _lookup(self, src: str, q: Query) -> list[str] | None:
        att = self._by_ip.get(src)
        if att is None:
            return None
        if att.policy.policy.join is not None and (
                peer := self.private.lookup(att.sandbox_id, q.name)) is not None:
            att.record("dns", True, f"a member of network {att.policy.policy.join}",
                       name=q.name)
            return [peer]
        if not att.policy.name_allowed(q.name):
            att.record("dns", False, "the name is not allowed", name=q.name)
            return None
        _serving.set(att)  # this task's (a query's) lookups count against its sandbox
        found = await self.resolve(q.name) if q.qtype in (QTYPE_A, QTYPE_AAAA) else []
        att.record("dns", True, "the name is allowed", name=q.name)
        return found

    def _admit(self, src: str) -> Callable[[], None] | None:
        att = self._by_ip.get(src)
        if att is None:
            return None
        if att.open >= MAX_CONNECTIONS:
            att.record("tcp", False, f"over {MAX_CONNECTIONS} connections at once")
            return None
        total, mine = sum(self._relays.values()), self._relays[att.owner]
        if total >= self.max_relays or (att.owner is not None and mine >= self.max_relays // 2):
            att.record("tcp", False, f"the host relays as many connections as it may "
                       f"({self.max_relays}; a tenant's sandboxes half of them): end some")
            return None
        att.open += 1
        self._relays[att.owner] += 1

        def done() -> None:
            att.open -= 1
            self._relays[att.owner] -= 1
        return done

    def _never(self, ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        links = netns.subnet() if addr.version == 4 else netns.subnet6()
        return (addr.is_loopback or addr in links or is_local(str(addr))
                or addr in private_subnet())

    async def _decide(self, src: str, name: str | None, ip: str, port: int
                      ) -> tuple[str | None, set[Conn] | None]:
        att = self._by_ip.get(src)
        if att is None:
            return None, None
        if name is not None:
            name = name.lower().rstrip(".")
            if not att.policy.name_allowed(name, port):
                att.record("tcp", False, f"the name {name} is not allowed", name=name, ip=ip,
                           port=port)
                return None, None
            _serving.set(att)  # this connection's task
            found = await self.resolve(name)
            if not found and self._proxied(name, port):
                att.record("tcp", True, f"the name {name} is allowed (through the host's "
                           "proxy, which resolves it)", name=name, port=port)
                return name, att.conns
            if not found:
                att.record("tcp", False, f"{name} does not resolve", name=name, port=port)
                return None, None
            ip = found[0]
        if self._never(ip):
            att.record("tcp", False, f"{ip} is the host or a sandbox: never reachable",
                       name=name, ip=ip, port=port)
            return None, None
        verdict = att.policy.decide(name, ipaddress.ip_address(ip), port)
        att.record("tcp", verdict.allowed, verdict.reason, name=name, ip=ip, port=port)
        if not verdict.allowed:
            return None, None
        # the address judged is the one dialed, through the host's proxy too (CONNECT ip:
        # a name would be resolved again there, maybe to the proxy's loopback or the
        # cloud's metadata address: DNS rebinding)
        return ip, att.conns

    def _proxied(self, host: str, port: int) -> bool:
        return upstream_proxy(self._proxy.proxies, host, port) is not None

    def _decide_udp(self, src: str, ip: str, port: int) -> set[Flow] | None:
        """A new UDP flow's verdict (the relay's): the flows to join, or None."""
        att = self._by_ip.get(src)
        if att is None:
            return None
        if self._never(ip):
            att.record("udp", False, f"{ip} is the host or a sandbox: never reachable", ip=ip,
                       port=port)
            return None
        verdict = att.policy.decide_udp(ipaddress.ip_address(ip), port)
        att.record("udp", verdict.allowed, verdict.reason, ip=ip, port=port)
        return att.flows if verdict.allowed else None
