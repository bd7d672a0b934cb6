"""The engine's worker thread: prefills, batched verifies and Generate streams on one model.

One thread owns the model. Each turn it takes what is queued: opens (prefill),
verifies and new Generate streams. A lone Generate stream with nothing else to do
decodes in a tight loop on its own cache object (one forward per token, as plain
greedy decoding does: no queue hop, no copy of the past), handing each token to its
channel, and leaves the loop as soon as anything else is queued. Otherwise every
active stream and every queued verify share one batched forward per turn (a newcomer
joins at the next step; `fedge.edge.verifier.batching` pads them). A lone verify also runs
on its session's cache object and crops the rejected positions.

Fair shares where the resource is spent: opens are refused before their prefill runs when
their owner has no room (`SessionStore.make_slot`); a batch reserves each owner's growth
for that owner alone, and fails only the members of an owner refused room; each step's rows
are shared by owner (`fair_rows`), the rows above an owner's share waiting a step, and so
are its prefills (`fair_opens`: one per owner per step while others have work).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from fedge.edge import _hf
from fedge.edge.speculative import greedy_choices_verdict, sampling_verdict
from fedge.edge.verifier.errors import Overloaded
from fedge.edge.verifier.jobs import (
    GenerateJob,
    Job,
    PrefillJob,
    Stream,
    VerifyJob,
    WorkerParts,
    fail_job,
    reject,
    resolve,
)
from fedge.edge.verifier.requests import Sampling, SessionInfo, VerifyResult, derive_seed
from fedge.edge.verifier.sessions import Replay, Session

LOG = logging.getLogger("fedge.verifier")
ACTIVE_WINDOW_S = 0.05  # a session used this recently counts as a stream a batch should wait for
IDLE_POLL_S = 0.05  # an idle worker wakes this often to expire sessions and notice a stop


class Worker:
    """The loop of the engine's worker thread; every method runs on that thread."""

    def __init__(self, parts: WorkerParts) -> None:
        self.parts = parts
        self.model = parts.model
        self.runtime = parts.runtime
        self.sessions = parts.sessions
        self.observer = parts.observer
        self.streams: list[Stream] = []
        self.deferred: list[VerifyJob] = []  # claimed verifies of owners above this step's share
        self.opens: list[PrefillJob | GenerateJob] = []  # prefills held back a step (fair_opens)
        self._batch_ids = itertools.count(1)
        self._bytes_per_position = parts.geometry.bytes_per_position

    # ------------------------------------------------------------------ the loop
    def step(self) -> None:
        """One turn: take queued work, start it, then one solo run or one batched step."""
        jobs = self._collect()
        carried, self.deferred = self.deferred, []
        held_back, self.opens = self.opens, []
        try:
            verifies = carried + [
                job for job in jobs if isinstance(job, VerifyJob) and self._take(job)
            ]
            asked: list[PrefillJob | GenerateJob] = [*held_back]
            asked += [j for j in jobs if isinstance(j, (PrefillJob, GenerateJob))]
            busy = {v.session.owner for v in verifies} | {s.session.owner for s in self.streams}
            opens, self.opens = fair_opens(asked, busy)
            for job in opens:
                if isinstance(job, PrefillJob):
                    self._guarded_prefill(job)
                else:
                    self._start_stream(job)
            self.streams = [s for s in self.streams if self._live(s)]
            if not verifies and len(self.streams) == 1:
                self._solo(self.streams[0])
            else:
                run, later = fair_rows([*verifies, *self.streams])
                self.deferred = [m for m in later if isinstance(m, VerifyJob)]
                keep = {m.session.key for m in [*run, *later]}  # no eviction inside this step
                batchable = [m for m in run if self.runtime.batchable(m.session.cache)]
                for chunk in _chunks(batchable, self.parts.max_batch):
                    self._run_batch(chunk, keep)
                for member in run:  # sharded sessions run on their ring, one at a time
                    if not self.runtime.batchable(member.session.cache):
                        self._run_batch([member], keep)
                ran = {id(m) for m in run}  # streams that waited go first next step
                self.streams.sort(key=lambda stream: id(stream) in ran)
            self.streams = [s for s in self.streams if self._live(s)]
        except Exception as exc:  # a bug must cost the requests in hand, not the worker
            LOG.exception("verifier engine step failed; failing its requests")
            failed: list[Job] = [*carried, *held_back, *jobs]
            for held in failed:
                fail_job(held, exc)
            self.fail_streams(exc)

    def fail_streams(self, error: BaseException) -> None:
        """End every running stream and deferred verify with `error` and free their sessions."""
        for stream in self.streams:
            self._fail_stream(stream, error)
        self.streams = []
        for job in [*self.deferred, *self.opens]:
            fail_job(job, error)
        self.deferred, self.opens = [], []

    def _fail_stream(self, stream: Stream, error: BaseException) -> None:
        """End one stream with `error` and free its session."""
        stream.finished = True
        stream.job.channel.fail(error)
        self._release(stream)

    def _collect(self) -> list[Job]:
        """Queued jobs for this turn: waits for a first one only when no stream is running.

        Verifies arriving within the batching window join a verify that found other
        sessions active; a lone session or a running stream never waits.
        """
        jobs = self.parts.jobs
        try:
            busy = self.streams or self.deferred or self.opens
            first = jobs.get_nowait() if busy else jobs.get(timeout=IDLE_POLL_S)
        except queue.Empty:
            if not self.streams and self.sessions.expire():
                self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)
            return []
        collected, verifies = [first], int(isinstance(first, VerifyJob))
        window = 0.0
        recent = self.sessions.active_since(self.parts.clock() - ACTIVE_WINDOW_S)
        if verifies and not self.streams and recent > 1:
            window = self.parts.batch_window_s
        deadline = time.monotonic() + window
        while verifies < self.parts.max_batch:
            remaining = deadline - time.monotonic()
            try:
                job = jobs.get(timeout=remaining) if remaining > 0 else jobs.get_nowait()
            except queue.Empty:
                break
            collected.append(job)
            verifies += isinstance(job, VerifyJob)
        return collected

    def _take(self, job: PrefillJob | VerifyJob) -> bool:
        """Claim a job for running; False (and its session released) if its caller is gone."""
        if job.future.set_running_or_notify_cancel():
            return True
        if isinstance(job, VerifyJob):
            job.session.busy = False
        self.observer.on_abandoned("verify" if isinstance(job, VerifyJob) else "open")
        return False

    def _live(self, stream: Stream) -> bool:
        """False for a finished stream, or a cancelled one (whose session is then freed)."""
        if stream.finished:
            return False
        if stream.job.channel.cancelled:
            self.observer.on_abandoned("generate")
            self._release(stream)
            return False
        if not self.sessions.holds(stream.session):  # preempted: its owner was above its share
            self._fail_stream(
                stream,
                Overloaded(
                    "this device held more than its fair share of the verifier's KV memory "
                    "while another device needed its own; stream stopped, retry later"
                ),
            )
            return False
        return True

    # ------------------------------------------------------------------ opens
    def _guarded_prefill(self, job: PrefillJob) -> None:
        """Run a prefill unless its caller is gone, routing any error to its future."""
        if not self._take(job):
            return
        try:
            resolve(job.future, self._prefill(job))
        except Exception as exc:  # the future carries it to the caller
            reject(job.future, exc)

    def _prefill(self, job: PrefillJob) -> SessionInfo:
        """Fill the KV cache with all prompt tokens but the last, which stays pending."""
        self.sessions.make_slot(job.owner)  # refused before any compute is spent on it
        past = job.prompt[:-1]
        self.sessions.reserve(self.runtime.local_bytes(len(past)), set(), job.owner)
        cache, _ = self.runtime.prefill(past)
        try:
            self._admit(
                self._session(job.session_id, cache, job.prompt[-1], job.sampling, job.owner)
            )
        except Exception:
            self.runtime.release(cache)
            raise
        return self.parts.session_info(job.session_id)

    def _session(
        self, session_id: str, cache: Any, pending: int, sampling: Sampling, owner: str
    ) -> Session:
        """A new session holding `cache`; its random draws derive from its seed per position."""
        seed = sampling.seed or derive_seed(session_id)
        return Session(
            session_id=session_id,
            cache=cache,
            pending=pending,
            temperature=sampling.temperature,
            seed=seed,
            last_used=self.parts.clock(),
            owner=owner,
        )

    def _admit(self, session: Session) -> None:
        """Put a new session in the store (which may evict idle ones or refuse)."""
        self.sessions.add(session)
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)

    # ------------------------------------------------------------------ streams
    def _start_stream(self, job: GenerateJob) -> None:
        """Prefill the whole prompt in a private session and emit the first token."""
        if job.channel.cancelled:
            self.observer.on_abandoned("generate")
            return
        try:
            self.sessions.make_slot(job.owner)
            self.sessions.reserve(self.runtime.local_bytes(len(job.prompt)), set(), job.owner)
            cache, logits = self.runtime.prefill(job.prompt, want_logits=True)
            session = self._session(uuid.uuid4().hex, cache, -1, job.sampling, job.owner)
            session.busy = True  # never idle: only preempted, when its owner is above its share
            session.stream = True
            try:
                self._admit(session)
            except Exception:
                self.runtime.release(cache)
                raise
        except Exception as exc:  # the channel carries it to the caller
            job.channel.fail(exc)
            return
        stream = Stream(job, session)
        self.streams.append(stream)
        self._emit(stream, self._choose(session, logits[0, -1:]))

    def _solo(self, stream: Stream) -> None:
        """Decode a lone stream in place until it ends, is cancelled, or other work is queued."""
        session, channel = stream.session, stream.job.channel
        keep, jobs, stop = {session.key}, self.parts.jobs, self.parts.stop
        try:
            while not (stream.finished or channel.cancelled or stop.is_set()):
                started = time.monotonic()
                if self.runtime.batchable(session.cache):
                    self.sessions.reserve(self._bytes_per_position, keep, session.owner)
                logits = self.runtime.forward_on(torch.tensor([[session.pending]]), session.cache)
                self.sessions.resized(session)
                self._emit(stream, self._choose(session, logits[0, -1:]))
                self.observer.on_batch(1, time.monotonic() - started)
                if not jobs.empty():
                    break  # a newcomer: the next turn batches it with this stream
        except Exception as exc:  # costs this stream only
            self._fail_stream(stream, exc)
        session.last_used = self.parts.clock()
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)

    def _choose(self, session: Session, logits: torch.Tensor) -> int:
        """The next token from one position's logits [1, V]: argmax, or a sample at the temperature."""
        if session.temperature == 0.0:
            return int(logits[0].argmax())
        probs = torch.softmax(logits.double() / session.temperature, dim=-1)
        vocab = probs.shape[1]
        empty_q = torch.zeros(0, dtype=torch.float64)
        return sampling_verdict(
            [],
            empty_q,
            torch.zeros(0, vocab, dtype=torch.float64),
            probs,
            session.draws(session.length),
        ).next_token

    def _emit(self, stream: Stream, token: int) -> None:
        """Commit `token` to the stream's session, send it, and end the stream when done."""
        stream.session.pending = token
        job = stream.job
        job.channel.put(token)
        if job.channel.produced >= job.max_new_tokens or token == job.stop_token:
            stream.finished = True
            job.channel.close()
            self._release(stream)

    def _release(self, stream: Stream) -> None:
        """Free a stream's session (it may already be gone)."""
        self._discard(stream.session)

    def _discard(self, session: Session) -> None:
        """Drop a session from the store; the edge reopens it if it still needs it."""
        session.busy = False
        with contextlib.suppress(Exception):
            self.sessions.remove(session.session_id, session.owner)
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)

    # ------------------------------------------------------------------ batches
    def _run_batch(
        self, members: Sequence[VerifyJob | Stream], keep: set[str] | None = None
    ) -> None:
        """One forward for verifies and stream steps; each gets its verdict or its error.

        A lone member runs on its session's cache object; several are padded into one batch.
        """
        started = time.monotonic()
        times_ns = [time.time_ns()]  # batch start, forward start, forward end, verdicts start
        members, held = self._reserve_growth(members, keep or set())
        if not members:
            return
        inputs = [
            [m.session.pending, *m.draft.ids] if isinstance(m, VerifyJob) else [m.session.pending]
            for m in members
        ]
        starts = [m.session.length for m in members]  # a lone forward grows the cache in place
        try:
            times_ns.append(time.time_ns())
            logits, new_kv = self._forward(members, inputs)
            times_ns.append(time.time_ns())
        except Exception as exc:
            for member in members:  # a batched forward touched no session's cache
                self._fail_member(member, exc, touched=len(members) == 1)
            return
        finally:
            for owner, nbytes in held.items():
                self.sessions.release(owner, nbytes)
        choices = logits.argmax(dim=-1).tolist()  # [B, T]: all greedy sessions need
        times_ns.append(time.time_ns())  # before any caller can have its reply
        for row, member in enumerate(members):
            new = (
                None
                if new_kv is None
                else [(k[row : row + 1], v[row : row + 1]) for k, v in new_kv]
            )
            try:
                if isinstance(member, VerifyJob):
                    self._commit(member, logits[row], choices[row], new, starts[row])
                else:
                    self._step_stream(member, logits[row, :1], new)
            except Exception as exc:
                self._fail_member(member, exc, touched=True)
        self.observer.on_batch(len(members), time.monotonic() - started)
        verifies = [m for m in members if isinstance(m, VerifyJob)]
        if self.parts.tracing.tracer is not None and verifies:
            self.parts.tracing.record_batch(
                [job.trace for job in verifies],
                next(self._batch_ids),
                (times_ns[0], times_ns[1], times_ns[2], times_ns[3]),
                [job.queued_ns for job in verifies],
            )
        self.observer.on_sessions(len(self.sessions), self.sessions.total_bytes)

    def _reserve_growth(
        self, members: Sequence[VerifyJob | Stream], keep: set[str]
    ) -> tuple[list[VerifyJob | Stream], dict[str, int]]:
        """Hold each owner's KV growth for this pass, smallest holder first; the members of an
        owner refused room fail alone (Overloaded), untouched. Returns the rest and the holds.

        Each owner makes room for its own growth only (`SessionStore.reserve`): another owner's
        idle session goes only when that owner is above its fair share.
        """
        keep = keep | {m.session.key for m in members}
        growth: dict[str, int] = {}
        for m in members:
            if not self.runtime.batchable(m.session.cache):
                continue  # a sharded session's KV lives in its ring workers, under their cap
            fed = len(m.draft.ids) + 1 if isinstance(m, VerifyJob) else 1
            growth[m.session.owner] = growth.get(m.session.owner, 0) + fed
        held: dict[str, int] = {}
        refused: dict[str, BaseException] = {}
        for owner in sorted(growth, key=self.sessions.bytes_of):
            nbytes = growth[owner] * self._bytes_per_position
            try:
                self.sessions.reserve(nbytes, keep, owner, hold=True)
            except Overloaded as exc:
                refused[owner] = exc
                continue
            held[owner] = nbytes
        for m in members:
            if m.session.owner in refused:
                self._fail_member(m, refused[m.session.owner], touched=False)
        return [m for m in members if m.session.owner not in refused], held

    def _forward(
        self, members: Sequence[VerifyJob | Stream], inputs: list[list[int]]
    ) -> tuple[torch.Tensor, _hf.KV | None]:
        """Logits [B, T, V], and the new positions' KV per layer when batched (None when in place)."""
        caches = [m.session.cache for m in members]
        if len(members) == 1:
            return self.runtime.forward_on(torch.tensor(inputs), caches[0]), None
        return self.runtime.batched_forward(caches, inputs)

    def _keep(self, session: Session, new: _hf.KV | None, kept: int, fed: int) -> None:
        """Keep the KV of the first `kept` of the `fed` positions a forward computed."""
        if new is None:
            _hf.drop_last(session.cache, fed - kept)
        else:
            _hf.append_kv(session.cache, [(k[:, :, :kept], v[:, :, :kept]) for k, v in new])
        self.sessions.resized(session)

    def _fail_member(self, member: VerifyJob | Stream, error: BaseException, touched: bool) -> None:
        """End one batch member with `error`; a session whose cache it may have changed is dropped."""
        if isinstance(member, Stream):
            self._fail_stream(member, error)
            return
        if touched:  # the edge reopens it from its committed tokens
            self._discard(member.session)
        else:
            member.session.busy = False
        reject(member.future, error)

    def _step_stream(self, stream: Stream, logits: torch.Tensor, new: _hf.KV | None) -> None:
        """A stream's share of a batched step: keep its one new position, emit its next token."""
        token = self._choose(stream.session, logits)
        self._keep(stream.session, new, 1, 1)
        self._emit(stream, token)

    def _commit(
        self,
        job: VerifyJob,
        logits: torch.Tensor,
        choices: list[int],
        new: _hf.KV | None,
        start: int,
    ) -> None:
        """Decide one verify's verdict, keep the KV of its accepted tokens, reply.

        `start` is the session's length before this verify (a retry of it expects that).
        """
        session, draft = job.session, job.draft
        k = len(draft.ids)
        if draft.probs is None or draft.dists is None:  # greedy session (see _check_draft)
            verdict = greedy_choices_verdict(draft.ids, choices[: k + 1])
        else:
            probs = torch.softmax(logits[: k + 1].double() / session.temperature, dim=-1)
            verdict = sampling_verdict(
                draft.ids, draft.probs, draft.dists, probs, session.draws(start)
            )
        self._keep(session, new, verdict.accepted + 1, k + 1)  # pending plus accepted drafts
        session.pending = verdict.next_token
        session.last_used = self.parts.clock()
        self.observer.on_verify(k, verdict.accepted)
        result = VerifyResult(verdict.accepted, verdict.next_token, session.length)
        session.last = Replay(start, tuple(draft.ids), result)
        session.busy = False  # before the reply: the caller may verify again at once
        resolve(job.future, result)


def fair_rows(
    members: Sequence[VerifyJob | Stream],
) -> tuple[list[VerifyJob | Stream], list[VerifyJob | Stream]]:
    """This step's rows and those that wait: compute shared max-min among owners.

    With two or more owners in the step, no owner gets more rows than the second-largest
    demand (so one owner's many streams or verifies never make the step, hence every
    other owner's latency, more than about twice what the others make it); the rest wait a
    step, its streams in turn. An owner alone gets every row.
    """
    by_owner: dict[str, list[VerifyJob | Stream]] = {}
    for m in members:
        by_owner.setdefault(m.session.owner, []).append(m)
    if len(by_owner) < 2:
        return list(members), []
    level = sorted(len(group) for group in by_owner.values())[-2]
    run: list[VerifyJob | Stream] = []
    later: list[VerifyJob | Stream] = []
    for group in by_owner.values():
        run += group[:level]
        later += group[level:]
    return run, later


def fair_opens(
    opens: list[PrefillJob | GenerateJob], busy: set[str]
) -> tuple[list[PrefillJob | GenerateJob], list[PrefillJob | GenerateJob]]:
    """This step's prefills and those held back: one per owner while other owners have work
    (`busy`: owners of this step's verifies and streams), so one device's burst of opens does
    not stall everyone's step; an owner alone prefills all it asked."""
    owners = {job.owner for job in opens} | busy
    if len(owners) < 2:
        return opens, []
    now: list[PrefillJob | GenerateJob] = []
    later: list[PrefillJob | GenerateJob] = []
    seen: set[str] = set()
    for job in opens:
        (later if job.owner in seen else now).append(job)
        seen.add(job.owner)
    return now, later


def _chunks(members: list[Any], size: int) -> list[list[Any]]:
    """`members` in consecutive groups of at most `size`."""
    return [members[i : i + size] for i in range(0, len(members), size)]
