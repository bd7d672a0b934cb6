"""The fleet's shared state in a Redis server: every ingress reads and writes the same keys.

Keys under one prefix: `routing` (a hash: epoch, stable, canary, fraction, limits), `fleet`
(the sealed FleetConfig: `fedge.edge.fleet.sealed`, never a pickle), `rollout` (progress
JSON), `versions` (version -> application), `session:<owner digest>:<id>` (application and
replica), `owner:<owner digest>` (a sorted set of the owner's session ids by last call),
`bucket:<kind>:<device>` (tokens and stamp, expiring once full), `arm:<app>` (canary counts,
sessions, latencies).

A session's key dies with the session: deleted when it closes or its replica lost it
(NOT_FOUND), expiring `session_ttl_s` after its last call (the verifier's idle timeout, after
which the replica has evicted it anyway: each call renews it), and at most
`max_sessions_per_owner` per owner (the owner's least recently called go first), so no device
grows the store beyond what its sessions on the replicas can hold.
Token buckets are charged by a Lua script on the server's clock, so a charge is atomic
and every ingress sees one clock; a routing change is one MULTI, so no reader sees half.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from fedge.edge.fleet.state import ROUTING, Routing
from fedge.edge.fleet.stats import ArmStats, CallOutcome
from fedge.edge.verifier.rate_config import RateLimitConfig

SESSION_TTL_S = 24 * 3600  # default: a session's home is forgotten this long after its last call
MAX_SESSIONS_PER_OWNER = 1024  # default cap of one owner's session keys

# Remember a session's home under its owner's cap. KEYS[1]: the session's key, KEYS[2]: the
# owner's sorted set. ARGV: session id, "app\nreplica", ttl ms, cap, session key prefix.
# Drops the owner's sessions that expired, then the least recently called beyond the cap.
# Each call scores above every score the set holds (the clock in ms, to the microsecond, or
# just above the newest; written with 17 digits, as Lua's own 14 would round it), so the set's
# order is the order of calls: calls in the same millisecond once tied, and the sorted set broke
# the tie by session id, evicting recent sessions before older ones.
REMEMBER_SCRIPT = """
redis.replicate_commands()
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local newest = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
if newest[2] and tonumber(newest[2]) >= now then
  now = tonumber(newest[2]) + 0.001
end
local ttl, cap = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
redis.call('ZADD', KEYS[2], string.format('%.17g', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%.17g', now - ttl))
local excess = redis.call('ZCARD', KEYS[2]) - cap
if excess > 0 then
  local oldest = redis.call('ZRANGE', KEYS[2], 0, excess - 1)
  for _, sid in ipairs(oldest) do
    redis.call('DEL', ARGV[5] .. sid)
    redis.call('ZREM', KEYS[2], sid)
  end
end
redis.call('PEXPIRE', KEYS[2], ttl)
return excess
"""
LATENCY_KEEP = 20_000  # canary latencies kept per application (= stats.LATENCY_WINDOW)

# One token bucket, charged or refunded atomically on the server's clock. KEYS[1]: the
# bucket's hash (tokens, stamp). ARGV: rate, burst, cost, needed, mode ("take"|"refund").
# Returns the seconds to wait as a string ("0" when granted). A full bucket expires: an
# absent key is a full bucket, so idle devices cost no memory.
BUCKET_SCRIPT = """
redis.replicate_commands()
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local cost, needed, mode = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local saved = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = burst
if saved[1] then
  tokens = math.min(burst, tonumber(saved[1]) + math.max(0, now - tonumber(saved[2])) * rate)
end
local wait = 0
if mode == 'refund' then
  tokens = math.min(burst, tokens + cost)
elseif tokens >= needed then
  tokens = tokens - cost
else
  wait = (needed - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.9f', tokens),
           'stamp', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return string.format('%.9f', wait)
"""

# Write the declared routing unless the stored one belongs to this epoch. KEYS: routing hash,
# fleet key, rollout key, versions hash. ARGV: epoch, stable, canary, fraction, limits, fleet.
START_SCRIPT = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'stable', ARGV[2], 'canary', ARGV[3],
             'fraction', ARGV[4], 'limits', ARGV[5])
  redis.call('SET', KEYS[2], ARGV[6])
end
return redis.call('HMGET', KEYS[1], 'stable', 'canary', 'fraction', 'limits')
"""


def limits_json(config: RateLimitConfig) -> str:
    """A RateLimitConfig as the JSON the state stores."""
    return json.dumps(asdict(config), sort_keys=True)


def _routing(stable: Any, canary: Any, fraction: Any, limits: Any) -> Routing:
    """A Routing from the stored strings (bytes as Redis returns them)."""

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value or "")

    return Routing(
        text(stable),
        text(canary) or None,
        float(text(fraction) or 0.0),
        RateLimitConfig(**json.loads(text(limits) or "{}")),
    )


def redis_password(path: Path | None) -> str | None:
    """The Redis password from its file (one line; None without a file)."""
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(f"Redis password file {path} is missing; write the password in it")
    password = path.read_text().strip()
    if not password:
        raise ValueError(f"Redis password file {path} is empty; write the password in it")
    return password


def check_redis_url(url: str) -> str:
    """Refuse a URL that is not Redis's or that carries a password (it belongs in a file)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"redis URL {url!r}: use redis://HOST:PORT/DB, rediss:// (TLS) or unix:///PATH"
        )
    if parts.password:
        raise ValueError(
            "the redis URL carries a password; drop it from the URL and put it in the "
            "Redis password file (--redis-password-file)"
        )
    checks = {k.lower(): v.lower() for k, v in parse_qsl(parts.query)}
    if checks.get("ssl_cert_reqs", "required") != "required" or checks.get(
        "ssl_check_hostname"
    ) in ("false", "0", "no"):
        raise ValueError(
            f"redis URL {url!r} turns off the check of Redis's TLS certificate (the password "
            "would go to whoever answers); drop ssl_cert_reqs/ssl_check_hostname and give the "
            "CA that signed it: rediss://...?ssl_ca_certs=/path/ca.crt"
        )
    return url


class RedisBuckets:
    """One kind's token buckets in Redis: every ingress charges the same bucket, atomically."""

    def __init__(self, state: RedisState, kind: str, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._state, self._kind = state, kind

    async def _run(self, device: str, cost: int, needed: float, mode: str) -> float:
        key = self._state.key("bucket", self._kind, device)
        wait = await self._state.bucket_script(
            keys=[key], args=[repr(self.rate), self.burst, cost, repr(needed), mode]
        )
        return float(wait)

    async def take(self, device: str, cost: int, debt: bool = False) -> float:
        """Spend `cost` tokens: 0.0 when granted, else the seconds until they would be there."""
        return await self._run(device, cost, min(cost, self.burst) if debt else cost, "take")

    async def refund(self, device: str, amount: int) -> None:
        """Give back tokens a call reserved but did not use (never above the burst)."""
        await self._run(device, amount, 0.0, "refund")


class RedisState:
    """The fleet's state in a Redis server, shared by every ingress (keys under `prefix`)."""

    def __init__(
        self,
        client: Any,
        prefix: str = "fedge:fleet",
        session_ttl_s: float = SESSION_TTL_S,
        max_sessions_per_owner: int = MAX_SESSIONS_PER_OWNER,
    ) -> None:
        if session_ttl_s <= 0 or max_sessions_per_owner < 1:
            raise ValueError(
                f"RedisState needs session_ttl_s > 0 and max_sessions_per_owner >= 1, got "
                f"{session_ttl_s}, {max_sessions_per_owner}"
            )
        self.client = client
        self.prefix = prefix
        self.session_ttl_ms = max(1, int(session_ttl_s * 1000))
        self.max_sessions_per_owner = max_sessions_per_owner
        self.bucket_script = client.register_script(BUCKET_SCRIPT)
        self._start_script = client.register_script(START_SCRIPT)
        self._remember_script = client.register_script(REMEMBER_SCRIPT)

    @classmethod
    def connect(
        cls,
        url: str,
        password_file: Path | None = None,
        prefix: str = "fedge:fleet",
        session_ttl_s: float = SESSION_TTL_S,
        max_sessions_per_owner: int = MAX_SESSIONS_PER_OWNER,
    ) -> RedisState:
        """A state over the Redis at `url` (password read from `password_file` now)."""
        from redis import asyncio as aioredis

        client = aioredis.from_url(check_redis_url(url), password=redis_password(password_file))
        return cls(client, prefix, session_ttl_s, max_sessions_per_owner)

    def key(self, *parts: str) -> str:
        """The Redis key of `parts` under this fleet's prefix."""
        return ":".join((self.prefix, *parts))

    def _owner_digest(self, owner: str) -> str:
        return hashlib.sha256(owner.encode()).hexdigest()[:32]  # fixed length: unambiguous

    def _session_key(self, owner: str, session_id: str) -> str:
        return self.key("session", self._owner_digest(owner), session_id)

    def _owner_key(self, owner: str) -> str:
        return self.key("owner", self._owner_digest(owner))

    def _keys(self) -> list[str]:
        return [self.key("routing"), self.key("fleet"), self.key("rollout"), self.key("versions")]

    async def start(self, epoch: str, routing: Routing, fleet: bytes) -> Routing:
        stored = await self._start_script(
            keys=self._keys(),
            args=[
                epoch,
                routing.stable,
                routing.canary or "",
                repr(routing.fraction),
                limits_json(routing.limits),
                fleet,
            ],
        )
        return _routing(*stored)

    async def route(self, owner: str, session_id: str) -> tuple[Routing, tuple[str, str] | None]:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(self.key("routing"), "stable", "canary", "fraction", "limits")
            if session_id:  # a call of the session: its home lives another idle timeout
                pipe.getex(self._session_key(owner, session_id), px=self.session_ttl_ms)
            replies = await pipe.execute()
        stored = replies[0]
        if stored[0] is None:
            raise RuntimeError(
                f"the fleet's routing is missing from Redis ({self.key('routing')}): "
                "was the Redis flushed? restart the fleet's ingress to write it again"
            )
        home = None
        if session_id and replies[1] is not None:
            app, _, replica = replies[1].decode().partition("\n")
            home = (app, replica)
        return _routing(*stored), home

    async def set_routing(
        self, routing: Routing, fleet: bytes | None = None, fields: tuple[str, ...] = ROUTING
    ) -> None:
        stored = {
            "stable": routing.stable,
            "canary": routing.canary or "",
            "fraction": repr(routing.fraction),
            "limits": limits_json(routing.limits),
        }
        async with self.client.pipeline(transaction=True) as pipe:  # one step for every reader
            pipe.hset(self.key("routing"), mapping={f: stored[f] for f in fields})
            if fleet is not None:
                pipe.set(self.key("fleet"), fleet)
            await pipe.execute()

    async def fleet(self) -> bytes:
        return bytes(await self.client.get(self.key("fleet")) or b"")

    async def remember(self, owner: str, session_id: str, app: str, replica: str) -> None:
        await self._remember_script(
            keys=[self._session_key(owner, session_id), self._owner_key(owner)],
            args=[
                session_id,
                f"{app}\n{replica}",
                self.session_ttl_ms,
                self.max_sessions_per_owner,
                self._session_key(owner, ""),
            ],
        )

    async def forget(self, owner: str, session_id: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._session_key(owner, session_id))
            pipe.zrem(self._owner_key(owner), session_id)
            await pipe.execute()

    async def sessions_per_replica(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        keys = [k async for k in self.client.scan_iter(match=self.key("session", "*"), count=1000)]
        for value in await self.client.mget(keys) if keys else []:
            if value is not None:
                replica = value.decode().partition("\n")[2]
                counts[replica] = counts.get(replica, 0) + 1
        return counts

    async def version_app(self, version: str) -> str | None:
        app = await self.client.hget(self.key("versions"), version)
        return None if app is None else str(app.decode())

    async def learn_version(self, version: str, app: str) -> None:
        await self.client.hset(self.key("versions"), version, app)

    def buckets(self, kind: str, rate: float, burst: int) -> RedisBuckets:
        return RedisBuckets(self, kind, rate, burst)

    async def record_arm(self, app: str, call: CallOutcome) -> None:
        probe = ArmStats()
        probe.record(call)
        counts = self.key("arm", app)
        async with self.client.pipeline(transaction=True) as pipe:
            for name in ("calls", "errors", "verifies", "drafted", "accepted"):
                if getattr(probe, name):
                    pipe.hincrby(counts, name, getattr(probe, name))
            for sid, (d, a) in probe.sessions.items():
                pipe.hincrby(self.key("arm", app, "sessions"), f"d:{sid}", d)
                pipe.hincrby(self.key("arm", app, "sessions"), f"a:{sid}", a)
            if probe.latencies:
                pipe.rpush(self.key("arm", app, "latency"), repr(probe.latencies[0]))
                pipe.ltrim(self.key("arm", app, "latency"), -LATENCY_KEEP, -1)
            await pipe.execute()

    async def arm_stats(self, apps: tuple[str, ...]) -> dict[str, ArmStats]:
        async with self.client.pipeline(transaction=True) as pipe:
            for app in apps:
                pipe.hgetall(self.key("arm", app))
                pipe.hgetall(self.key("arm", app, "sessions"))
                pipe.lrange(self.key("arm", app, "latency"), 0, -1)
            replies = await pipe.execute()
        stats = {}
        for index, app in enumerate(apps):
            counts, sessions, latencies = replies[3 * index : 3 * index + 3]
            arm = ArmStats()
            for name, value in counts.items():
                setattr(arm, name.decode(), int(value))  # calls, errors, verifies, drafted, ...
            arm.latencies.extend(float(v) for v in latencies)
            for name, value in sessions.items():
                kind, _, sid = name.decode().partition(":")
                arm.sessions.setdefault(sid, [0, 0])[kind == "a"] = int(value)
            stats[app] = arm
        return stats

    async def reset_arms(self, apps: tuple[str, ...]) -> None:
        keys = [self.key("arm", app, *part) for app in apps for part in ((), ("sessions",))]
        keys += [self.key("arm", app, "latency") for app in apps]
        if keys:
            await self.client.delete(*keys)

    async def rollout(self) -> dict[str, Any] | None:
        stored = await self.client.get(self.key("rollout"))
        return None if stored is None else dict(json.loads(stored))

    async def set_rollout(self, progress: dict[str, Any] | None) -> None:
        if progress is None:
            await self.client.delete(self.key("rollout"))
        else:
            await self.client.set(self.key("rollout"), json.dumps(progress, sort_keys=True))

    async def close(self) -> None:
        await self.client.aclose()
