"""Ring workers of the verifier: N processes that prefill a long prompt together and keep its KV sharded.

Each worker process holds the model (its weights shared with the engine's process through
torch's shared-memory pickling, not copied) and joins a `torch.distributed` group (gloo on CPU,
NCCL when every rank has a GPU). The engine's worker thread drives the ring through one pipe per
rank: every rank gets the same command (prefill, step), runs the model with ring attention
(`fedge.lm.ring`) and answers; rank 0's answer carries the logits. A sharded session is a
`ShardedKV` handle on the engine side: per-rank lengths, no tensors.

A rank that dies, errs or stalls fails the ring as a whole: the call in hand fails RingFailed
(UNAVAILABLE, naming the rank and its pid), the other ranks are ended, every sharded session is
dropped (its next verify meets NOT_FOUND and reopens from its committed tokens, as after a replica
death) and the next long prompt starts a fresh ring. No call ever answers from a partial ring.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from fedge.edge.verifier.errors import NotReady, Overloaded

LOG = logging.getLogger("fedge.verifier")

__all__ = ["RingConfig", "RingFailed", "RingPool", "ShardedKV"]


@dataclass(frozen=True)
class RingConfig:
    """How the verifier shards long prompts over ring workers."""

    size: int = 2  # ring worker processes
    threshold: int = 2048  # prompts of more tokens than this are prefilled by the ring
    block: int = 256  # key positions per attention score block (score memory Tq x block)
    kv_cap_bytes: int = 1 << 30  # KV each ring worker may hold, over all its sessions
    threads: int = 1  # torch intra-op threads per ring worker
    timeout_s: float = 600.0  # a ring call silent this long counts as a dead ring
    start_timeout_s: float = 300.0  # spawning N interpreters that import torch is slow when busy

    def __post_init__(self) -> None:
        for name in ("size", "threshold", "block", "kv_cap_bytes", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"RingConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.size < 2:
            raise ValueError(
                f"RingConfig.size must be >= 2 (a ring of one is no ring), got {self.size}"
            )
        if self.threshold < 2 * self.size:
            raise ValueError(
                f"RingConfig.threshold must be >= 2 * size = {2 * self.size} (every rank holds "
                f"two chunks of a sharded prompt), got {self.threshold}"
            )
        if self.timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("RingConfig.timeout_s and start_timeout_s must be > 0")


class RingFailed(NotReady):
    """A ring worker died, erred or stalled: the call fails UNAVAILABLE and sharded sessions go."""


class ShardedKV:
    """Engine-side handle of a sharded session's KV: its length per rank; the tensors live in the ring.

    It answers the cache calls the engine makes (`get_seq_length`, `crop`) and holds no
    tensor here (`layers` is empty, so the engine's KV cap does not count it: the ring's
    per-rank cap does).
    """

    layers: tuple[()] = ()

    def __init__(self, pool: RingPool, key: str, lengths: list[int], generation: int) -> None:
        self.pool = pool
        self.key = key
        self.lengths = lengths  # positions held by each rank
        self.generation = generation  # the ring it lives on; a restarted ring lost it
        self.last_owner = -1  # rank that took the last step's positions (crop applies there)
        self.released = False

    def get_seq_length(self, layer: int = 0) -> int:
        return sum(self.lengths)

    def crop(self, max_length: int) -> None:
        """DynamicCache semantics: a negative `max_length` drops that many last positions."""
        drop = -max_length if max_length < 0 else self.get_seq_length() - max_length
        if drop > 0:
            self.pool.crop(self, drop)


@dataclass
class _Rank:
    process: Any  # multiprocessing.Process
    conn: Connection
    pid: int = 0


class RingPool:
    """N ring worker processes on this machine, started together and failed together."""

    def __init__(self, model: torch.nn.Module, config: RingConfig, bytes_per_position: int) -> None:
        self.model = model
        self.config = config
        self.bytes_per_position = bytes_per_position
        self.generation = 0
        self.usage = [0] * config.size  # KV positions held per rank
        self.last_stats: list[dict[str, Any]] = []
        self._ranks: list[_Rank] = []
        self._store_dir: str | None = None
        self._lock = threading.RLock()  # one ring call at a time (the pipes carry no ids)
        self._usage_lock = threading.Lock()  # usage, generation, releases
        self._drops: collections.deque[tuple[int, str]] = collections.deque()
        self._on_failure: list[Callable[[], None]] = []
        self._keys = 0
        self.in_flight: str | None = None  # the ring command under way (tests watch it)

    # ------------------------------------------------------------------ lifecycle
    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (after the ring is torn down) whenever the ring fails."""
        self._on_failure.append(callback)

    @property
    def running(self) -> bool:
        return bool(self._ranks) and all(r.process.is_alive() for r in self._ranks)

    @property
    def pids(self) -> list[int]:
        """Process ids of the ring workers (rank order)."""
        return [r.pid for r in self._ranks]

    def start(self) -> None:
        """Spawn the ring workers and wait until every rank joined the process group."""
        with self._lock:
            if self.running:
                return
            self._teardown()
            context = mp.get_context("spawn")
            self._store_dir = tempfile.mkdtemp(prefix="fedge-ring-")
            store = os.path.join(self._store_dir, "store")
            for rank in range(self.config.size):
                parent, child = context.Pipe()
                process = context.Process(
                    target=_serve_rank,
                    args=(rank, self.config, store, self.model, child),
                    name=f"fedge-ring-{rank}",
                    daemon=True,
                )
                process.start()
                child.close()
                self._ranks.append(_Rank(process, parent))
            replies = self._collect("start", self.config.start_timeout_s)
            for member, reply in zip(self._ranks, replies, strict=True):
                member.pid = int(reply)
            self.usage = [0] * self.config.size
            LOG.info("ring of %d workers up (pids %s)", self.config.size, self.pids)

    def stop(self) -> None:
        """End the ring workers (asking first, then by pid)."""
        with self._lock:
            for rank in self._ranks:
                with contextlib.suppress(OSError, ValueError):
                    rank.conn.send(("stop",))
            self._teardown(grace_s=5.0)

    def _teardown(self, grace_s: float = 0.0) -> None:
        for rank in self._ranks:
            rank.process.join(grace_s)
            if rank.process.is_alive():
                rank.process.terminate()  # SIGTERM to this rank's pid only
                rank.process.join(5.0)
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join()
            rank.conn.close()
        self._ranks = []
        self._drops.clear()
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    # ------------------------------------------------------------------ calls
    def prefill(
        self, tokens: Sequence[int], want_logits: bool = False, overlap: bool = True
    ) -> tuple[ShardedKV, Any]:
        """Prefill `tokens` over the ring; returns the handle and (when asked) logits [1, L, V].

        The per-rank KV cap is checked first (Overloaded, nothing spent). `overlap=False`
        waits for each transfer before computing (the bench's comparison).
        """
        from fedge.lm.ring import ZigzagLayout

        with self._lock:
            self.start()
            layout = ZigzagLayout(len(tokens), self.config.size)
            sizes = [layout.size(r) for r in range(self.config.size)]
            for rank, size in enumerate(sizes):
                self._check_cap(rank, size)
            self._keys += 1
            key = f"s{self._keys}"
            replies = self._call(("prefill", key, list(tokens), want_logits, overlap), "prefill")
            with self._usage_lock:
                for rank, size in enumerate(sizes):
                    self.usage[rank] += size
            self.last_stats = [reply["stats"] for reply in replies]
            kv = ShardedKV(self, key, sizes, self.generation)
            if not want_logits:
                return kv, None
            logits = torch.empty(1, len(tokens), replies[0]["logits"].shape[-1])
            for rank, reply in enumerate(replies):
                logits[0, layout.positions(rank)] = reply["logits"]
            return kv, logits

    def step(self, kv: ShardedKV, tokens: Sequence[int]) -> torch.Tensor:
        """Run new tokens on a sharded session; logits [1, T, V]. The least-loaded rank keeps them."""
        with self._lock:
            self._check_live(kv)
            owner = min(range(self.config.size), key=lambda r: (self.usage[r], r))
            self._check_cap(owner, len(tokens))
            start = kv.get_seq_length()
            replies = self._call(("step", kv.key, list(tokens), start, owner), "verify")
            kv.lengths[owner] += len(tokens)
            kv.last_owner = owner
            with self._usage_lock:
                self.usage[owner] += len(tokens)
            logits: torch.Tensor = replies[0]["logits"]
            return logits

    def probe(self, length: int, layers: int, kv_heads: int, head_dim: int) -> list[float]:
        """Seconds each rank spends passing a `length`-token prefill's KV blocks round the ring
        with no attention to hide them (`layers` x (N-1) exchanges): the bench's overlap baseline."""
        with self._lock:
            self.start()
            replies = self._call(("probe", length, layers, kv_heads, head_dim), "probe")
            return [float(reply["comm_s"]) for reply in replies]

    def crop(self, kv: ShardedKV, positions: int) -> None:
        """Drop the last `positions` positions of a session (from its last step's owner)."""
        with self._lock:
            self._check_live(kv)
            owner = kv.last_owner
            if owner < 0 or positions > kv.lengths[owner]:
                raise ValueError(f"cannot crop {positions} positions of sharded session {kv.key}")
            self._send(owner, ("crop", kv.key, positions))
            kv.lengths[owner] -= positions
            with self._usage_lock:
                self.usage[owner] -= positions

    def release(self, kv: ShardedKV) -> None:
        """Free a session's KV on every rank (sent with the next call: safe from any thread)."""
        with self._usage_lock:  # not the ring's lock: a long prefill must not hold up a close
            if kv.released:
                return
            kv.released = True
            if kv.generation != self.generation:
                return  # its ring is gone, and its memory with it
            for rank, length in enumerate(kv.lengths):
                self.usage[rank] -= length
                self._drops.append((rank, kv.key))

    # ------------------------------------------------------------------ plumbing
    def _check_cap(self, rank: int, positions: int) -> None:
        need = (self.usage[rank] + positions) * self.bytes_per_position
        if need > self.config.kv_cap_bytes:
            raise Overloaded(
                f"ring worker {rank} would hold {need} KV bytes, over its cap of "
                f"{self.config.kv_cap_bytes}; retry later or raise the ring's per-worker cap"
            )

    def _check_live(self, kv: ShardedKV) -> None:
        if kv.released or kv.generation != self.generation or not self._ranks:
            raise RingFailed(
                "this sharded session's ring workers are gone; reopen it from your committed tokens"
            )

    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        try:
            self._ranks[rank].conn.send(message)
        except (OSError, ValueError) as exc:
            self._fail(f"ring worker {rank} (pid {self._ranks[rank].pid}) is unreachable ({exc!r})")

    def _call(self, message: tuple[Any, ...], what: str) -> list[dict[str, Any]]:
        """Send `message` to every rank (after queued drops) and collect one reply per rank."""
        while self._drops:
            rank, key = self._drops.popleft()
            self._send(rank, ("drop", key))
        self.in_flight = what
        try:
            for rank in range(len(self._ranks)):
                self._send(rank, message)
            return self._collect(what, self.config.timeout_s)
        finally:
            self.in_flight = None

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """One reply per rank; any death, error or silence past `timeout_s` fails the ring."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        by_conn = {id(r.conn): i for i, r in enumerate(self._ranks)}
        by_sentinel = {r.process.sentinel: i for i, r in enumerate(self._ranks)}
        while len(replies) < len(self._ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [i for i in range(len(self._ranks)) if i not in replies]
                self._fail(f"ring worker(s) {missing} gave no answer to {what} in {timeout_s} s")
            waiting: list[Any] = [r.conn for i, r in enumerate(self._ranks) if i not in replies]
            waiting += [r.process.sentinel for i, r in enumerate(self._ranks) if i not in replies]
            for ready in wait(waiting, remaining):
                if isinstance(ready, int):
                    rank = by_sentinel[ready]
                    if rank in replies:
                        continue
                    self._fail_dead(rank, what)
                rank = by_conn[id(ready)]
                try:
                    status, payload = self._ranks[rank].conn.recv()
                except (EOFError, OSError):
                    # a closed pipe is a rank dying: name its death (pid, exit code) once seen
                    if wait([self._ranks[rank].process.sentinel], 2.0):
                        self._fail_dead(rank, what)
                    status, payload = "error", "closed its pipe"
                if status != "ok":
                    # a peer's death makes the survivors' ring exchange fail: name the death
                    sentinels = [r.process.sentinel for i, r in enumerate(self._ranks) if i != rank]
                    for dead in wait(sentinels, 2.0):
                        self._fail_dead(by_sentinel[dead], what)  # type: ignore[index]
                    self._fail(f"ring worker {rank} failed during {what}: {payload}")
                replies[rank] = payload
        return [replies[i] for i in range(len(self._ranks))]

    def _fail_dead(self, rank: int, what: str) -> None:
        """Fail the ring for the death of `rank`, naming its pid and exit code."""
        member = self._ranks[rank]
        member.process.join(1.0)
        self._fail(
            f"ring worker {rank} (pid {member.pid or member.process.pid}) died during {what} "
            f"(exit code {member.process.exitcode})"
        )

    def _fail(self, reason: str) -> None:
        """Tear the ring down, drop its sessions (callbacks), raise RingFailed."""
        LOG.error("ring failed: %s; ending the other ring workers", reason)
        self._teardown()
        with self._usage_lock:
            self.generation += 1
            self.usage = [0] * self.config.size
        for callback in self._on_failure:
            try:
                callback()
            except Exception:  # a callback must not hide the failure
                LOG.exception("ring failure callback raised")
        raise RingFailed(
            f"{reason}; the session's KV on the ring is gone: reopen it from your committed "
            "tokens (the next long prompt starts a fresh ring)"
        )


# ---------------------------------------------------------------------- the worker process
def _serve_rank(
    rank: int, config: RingConfig, store: str, model: torch.nn.Module, conn: Connection
) -> None:
    """Body of one ring worker: join the group, then answer the engine's commands until told to stop."""
    import torch.distributed as dist

    from fedge.lm.ring import RingShard, ZigzagLayout, enable_ring_attention, ring_session

    torch.set_num_threads(config.threads)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= config.size
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        model = model.to(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=config.size,
        timeout=timedelta(seconds=config.timeout_s),
    )
    enable_ring_attention(model)
    shards: dict[str, RingShard] = {}
    conn.send(("ok", os.getpid()))
    with torch.inference_mode():
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            op = message[0]
            if op == "stop":
                break
            try:
                reply = _run_op(
                    op, message, rank, config, model, shards, device, RingShard, ZigzagLayout,
                    ring_session,
                )  # fmt: skip
            except Exception as exc:  # the engine fails the ring and tells the caller
                conn.send(("error", repr(exc)))
                continue
            if reply is not None:
                conn.send(("ok", reply))
    dist.destroy_process_group()


def _run_op(
    op: str,
    message: tuple[Any, ...],
    rank: int,
    config: RingConfig,
    model: torch.nn.Module,
    shards: dict[str, Any],
    device: torch.device,
    shard_cls: Any,
    layout_cls: Any,
    ring_session: Any,
) -> dict[str, Any] | None:
    """One command on this rank; None for the commands that get no reply (drop, crop)."""
    if op == "drop":
        shards.pop(message[1], None)
        return None
    if op == "crop":
        shards[message[1]].crop(message[2])
        return None
    if op == "prefill":
        _, key, tokens, want_logits, overlap = message
        layout = layout_cls(len(tokens), config.size)
        shard = shard_cls(layout, rank, config.block, overlap=overlap)
        positions = layout.positions(rank)
        ids = torch.tensor(tokens)[positions]
        before = _rss_reset()
        started = time.perf_counter()
        with ring_session(shard):
            out = model(
                input_ids=ids[None].to(device),
                position_ids=positions[None].to(device),
                use_cache=False,
                logits_to_keep=0 if want_logits else 1,
            )
        wall = time.perf_counter() - started
        peak = _rss_peak() - before
        shard.mode = "decode"
        shards[key] = shard
        stats = {
            "rank": rank,
            "wall_s": wall,
            "compute_s": shard.stats.compute_s,
            "wait_s": shard.stats.wait_s,
            "bytes_sent": shard.stats.bytes_sent,
            "kv_bytes": shard.nbytes,
            "peak_rss_delta": peak,
            "tokens": layout.size(rank),
        }
        logits = out.logits[0].float().cpu() if want_logits else None
        return {"stats": stats, "logits": logits}
    if op == "probe":
        _, length, layers, kv_heads, head_dim = message
        return {"comm_s": _probe(layout_cls(length, config.size), rank, layers, kv_heads, head_dim)}
    if op == "step":
        _, key, tokens, start, owner = message
        shard = shards[key]
        shard.owner = owner
        positions = torch.arange(start, start + len(tokens))
        with ring_session(shard):
            out = model(
                input_ids=torch.tensor([tokens], device=device),
                position_ids=positions[None].to(device),
                use_cache=False,
            )
        return {"logits": out.logits.float().cpu() if rank == 0 else None}
    raise ValueError(f"unknown ring command {op!r}")


def _probe(layout: Any, rank: int, layers: int, kv_heads: int, head_dim: int) -> float:
    """Time the ring exchanges of one prefill's KV blocks, one after another, no compute."""
    import torch.distributed as dist

    world = layout.world
    block = torch.randn(2, 1, kv_heads, layout.size(rank), head_dim)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(layers):
        current = block
        for step in range(world - 1):
            source = (rank - step - 1) % world
            incoming = torch.empty(2, 1, kv_heads, layout.size(source), head_dim)
            requests = [
                dist.isend(current, (rank + 1) % world),
                dist.irecv(incoming, (rank - 1) % world),
            ]
            for request in requests:
                if request is not None:
                    request.wait()
            current = incoming
    return time.perf_counter() - started


def _rss_reset() -> int:
    """Reset this process's peak RSS (Linux clear_refs 5) and return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    return _status_kb("VmRSS") * 1024


def _rss_peak() -> int:
    """Peak RSS since the last reset, in bytes (0 where /proc is not there)."""
    return _status_kb("VmHWM") * 1024


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
