"""The KV event fuzz target: raw frames through the subscriber, the C ingest and the store, checked.

One fuzz input is a little stream: records ``[ctl, length (u16 LE), body]``. Each record is one live
message of source 0 or 1 whose payload is ``body``; ``ctl`` also picks the seq (next, the same again,
a gap, back to 0) and how the frames look (normal, a foreign topic, too few or too many frames, a seq
frame of the wrong length), and bit 7 ends the chunk (the messages one wake-up of the subscriber hands
to the ingest thread). :func:`run` plays it, the way the subscriber feeds the index
(``EventSubscriber._on_live`` for every message, then ``Ingestor.apply_chunk`` per chunk), into three
stacks at once:

- ``c``: the production path: the C ingest (``_kvcore.Store.ingest``) into the compact store;
- ``py``: the Python decode path (``index/wire.py`` + ``Ingestor._apply_decoded``), same store type;
- ``dict``: the Python decode path into :class:`index.store_dict.DictPrefixStore`, the reference store.

and checks, after every chunk:

1. no exception escapes (a malformed payload is a counted decode error, a malformed event a counted
   bad event); logging is formatted too, so a bad format string shows;
2. ``py`` and ``dict`` hold exactly the same (every residency, mapping in eviction order, reference
   count, counter);
3. ``c`` and ``py`` hold exactly the same, unless the chunk has a case where their documented
   semantics differ (index/README.md: a parent resolved after it was removed, cleared, restarted
   or stored with another block size earlier in the same chunk); such inputs are counted as
   ``not_compared`` and only checked for 1 and 4;
4. the store's own invariants, in all three: the totals agree with the residencies; every residency
   a source holds is reachable from that source's engine-hash map (so BlockRemoved, AllBlocksCleared,
   a restart and a source's removal can end it); every reference count above one belongs to a held
   residency; after a restart the source holds nothing.

:func:`seed_inputs` builds inputs from the captured vLLM frames (tests/fixtures/vllm, both event
shapes). Used by tests/index/test_fuzz_ingest.py (bounded, deterministic) and, coverage-guided, by
``make fuzz`` (``python tests/kvfuzz.py``, atheris; with an ASan/UBSan build of the C core).
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

_KVCORE = os.environ.get("KVROUTER_KVCORE")
"""An instrumented build of the C core to load instead of the installed one (make fuzz)."""
if _KVCORE:  # before anything imports index._kvcore
    import importlib.util

    import index

    _spec = importlib.util.spec_from_file_location("index._kvcore", _KVCORE)
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["index._kvcore"] = _mod
    _spec.loader.exec_module(_mod)
    index._kvcore = _mod  # type: ignore[attr-defined]

import contextlib  # noqa: E402
import itertools  # noqa: E402

import zmq  # noqa: E402
from vllm_vectors import live_frames, load, scenarios  # noqa: E402

if __name__ == "__main__":  # coverage for the Python of index/ (atheris; only its modules: fast)
    import atheris

    _instrumented: Any = atheris.instrument_imports(include=["index"])
else:
    _instrumented = contextlib.nullcontext()
with _instrumented:
    from index import _kvcore
    from index.ingest import Ingestor, SourceStats
    from index.keys import BASE_ROOT
    from index.store import PrefixStore
    from index.store_dict import DictPrefixStore
    from index.subscriber import EventSubscriber, SourceConfig, _Source
    from index.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, WireError, decode_payload

BLOCK_SIZE = 4
"""The configured block size (sources may publish others: learned, logged, counted)."""
MAX_RESIDENCIES = 1 << 20
"""Far above what an input can store: eviction would be a third way for the paths to differ."""
SOURCES = (
    SourceConfig("e0", 0, "tcp://127.0.0.1:1"),
    SourceConfig("e1", 1, "tcp://127.0.0.1:1", topic="kv"),  # a topic: other topics are counted, skipped
)
END_CHUNK = 0x80
_STAT_FIELDS = [k for k in SourceStats.__slots__ if k != "last_applied"]


class Finding(AssertionError):
    """An invariant broke (the fuzzer reports it as a crash)."""


# ---- logging: formatted, never printed ----------------------------------------------------------


class _FormatEveryRecord(logging.Handler):
    """Formats every record (a bad format string raises here instead of being printed and lost)."""

    def emit(self, record: logging.LogRecord) -> None:
        record.getMessage()


def quiet_logging() -> None:
    """The index's loggers format every record and print none (inputs log thousands of warnings)."""
    for name in ("kvrouter.index", "kvrouter.subscriber"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [_FormatEveryRecord()]
        lg.propagate = False
        lg.setLevel(logging.DEBUG)


# ---- the input format ---------------------------------------------------------------------------


@dataclass
class Message:
    source: int
    seq_mode: int  # 0 next, 1 the last seq again, 2 a gap of one, 3 back to 0
    frame_mode: int  # 0-4 normal, 5 a foreign topic, 6 no payload frame, 7 a 7-byte seq frame
    body: bytes
    end_chunk: bool

    def ctl(self) -> int:
        return self.source | self.seq_mode << 1 | self.frame_mode << 3 | (END_CHUNK if self.end_chunk else 0)


def parse(data: bytes) -> list[Message]:
    """The records of an input (a cut record takes what is there)."""
    out = []
    i = 0
    while i < len(data):
        ctl = data[i]
        n = int.from_bytes(data[i + 1 : i + 3], "little")
        body = data[i + 3 : i + 3 + n]
        i += 3 + n
        out.append(Message(ctl & 1, (ctl >> 1) & 3, (ctl >> 3) & 7, body, bool(ctl & END_CHUNK)))
    return out


def encode(messages: Sequence[Message]) -> bytes:
    """An input from records (:func:`parse` inverts it)."""
    out = bytearray()
    for m in messages:
        out += bytes([m.ctl()]) + struct.pack("<H", len(m.body)) + m.body
    return bytes(out)


# ---- three stacks --------------------------------------------------------------------------------


_ENDPOINTS = itertools.count()


class Stack:
    """A subscriber, an ingestor and a store. Messages go in through ``_on_live``, except in the
    ``c`` stack, which receives them from an in-process socket through the subscriber's receive
    loop (the C loop, index/_kvrecv.h, when it is bound), so the C path compared below includes it."""

    def __init__(self, kind: str, ctx: zmq.Context[Any]) -> None:
        self.kind = kind
        self.store: Any = DictPrefixStore(MAX_RESIDENCIES) if kind == "dict" else PrefixStore(MAX_RESIDENCIES)
        self.ing = Ingestor(self.store, BLOCK_SIZE)
        if kind != "c":
            self.ing._core = None  # every payload decoded and applied in Python
        self.sub = EventSubscriber(self.ing, ctx=ctx)
        self.srcs = []
        for cfg in SOURCES:  # what _open does, minus the sockets
            src = _Source(cfg, self.ing.add_source(cfg.source_id))
            self.sub._sources[cfg.source_id] = src
            self.srcs.append(src)
        self.writers: list[zmq.Socket[Any]] = []
        if kind == "c":
            for i, src in enumerate(self.srcs):
                # the reader is the subscriber's kind of socket (index/zsock.py's), in its context
                reader, writer = self.sub.ctx.socket(self.sub._z.PAIR), ctx.socket(zmq.PAIR)
                endpoint = f"inproc://kvfuzz-{next(_ENDPOINTS)}-{i}"  # (never reused: closing is async)
                reader.bind(endpoint)
                writer.connect(endpoint)
                src.sub = reader
                self.writers.append(writer)

    def close(self) -> None:
        for sock in [*self.writers, *(s.sub for s in self.srcs if s.sub is not None)]:
            sock.close(0)

    def feed(self, messages: Sequence[Message]) -> list[tuple[int, Batch | bytes | None]]:
        """One wake-up's messages, then the chunk applied; returns the chunk."""
        chunk: list[tuple[int, Batch | bytes | None]] = []
        for m in messages:
            src = self.srcs[m.source]
            if self.writers:
                # one message at a time: its seq frame depends on the state the previous one left
                self.writers[m.source].send_multipart(frames_of(m, src))
                self.sub._drain_live(src, chunk)
            else:
                self.sub._on_live(src, frames_of(m, src), chunk)
        self.ing.apply_chunk(chunk)
        return chunk

    def counters(self) -> list[dict[str, Any]]:
        out = []
        for src in self.srcs:
            st = self.ing.stats[src.sidx]
            row = {k: getattr(st, k) for k in _STAT_FIELDS}
            row["last_ts"] = repr(row["last_ts"])  # (a NaN would never compare equal)
            row |= {k: getattr(src, k) for k in ("last_seq", "gaps", "lost", "restarts", "duplicates")}
            row["foreign_topic"] = src.foreign_topic
            row["decode_errors"] += src.wire_errors  # (the receive side counts its own, as status sums)
            out.append(row)
        return out


def frames_of(m: Message, src: _Source) -> list[bytes]:
    """The frames of a record's message, its seq from the source's state."""
    last = src.last_seq
    seq = [last + 1, max(last, 0), last + 2, 0][m.seq_mode]
    seq_frame = seq.to_bytes(8, "big")
    topic = src.topic
    if m.frame_mode == 5:
        topic = b"other"
    elif m.frame_mode == 6:
        return [topic, seq_frame]
    elif m.frame_mode == 7:
        seq_frame = seq_frame[1:]
    return [topic, seq_frame, m.body]


# ---- checks -----------------------------------------------------------------------------------------


def snapshot(store: Any) -> dict[str, Any]:
    """Everything a store holds, in comparable form."""
    return {
        "total": store.total,
        "evictions": store.evictions,
        "counts": [(c.source, c.blocks, c.unknown_removes, c.evicted) for c in store.counts()],
        "media": store._media,
        "emaps": [list(d.items()) for d in store._emaps],
        "refs": store._refs,
    }


def check_invariants(store: Any, where: str, snap: dict[str, Any] | None = None) -> None:
    """The store's own consistency (see the module docstring, check 4); ``snap``: its snapshot."""
    snap = snap or snapshot(store)
    media: list[dict[int, int]] = snap["media"]
    emaps = [dict(items) for items in snap["emaps"]]
    refs: dict[tuple[int, int, int], int] = snap["refs"]
    held = 0
    per: dict[tuple[int, int], int] = {}
    for m, keys in enumerate(media):
        for key, mask in keys.items():
            held += bin(mask).count("1")
            s = 0
            while mask:
                if mask & 1:
                    per[s, m] = per.get((s, m), 0) + 1
                    if s >= len(emaps) or key not in emaps[s].values():
                        raise Finding(f"{where}: source {s} holds key {key:#x} on medium {m} unreachably")
                mask >>= 1
                s += 1
    if held != snap["total"]:
        raise Finding(f"{where}: total {snap['total']} but {held} residencies held")
    names = store._media_names
    for c in store.counts():
        sidx = store.source_index(c.source)
        for name, n in c.blocks.items():
            if n != per.get((sidx, names.index(name)), 0):
                raise Finding(
                    f"{where}: {c.source} counts {n} on {name}, holds {per.get((sidx, names.index(name)))}"
                )
    for (key, s, m), count in refs.items():
        if count < 1 or not (m < len(media) and media[m].get(key, 0) >> s & 1):
            raise Finding(f"{where}: reference count {count} of ({key:#x}, {s}, {m}) without the residency")


@dataclass
class Outcome:
    """What one input did (summed over inputs by the runners)."""

    messages: int = 0
    payloads: int = 0
    """Messages whose payload reached the decoder (three frames, an 8-byte seq)."""
    chunks: int = 0
    compared: int = 0
    """Chunks where the C path and the Python path were compared."""
    not_compared: int = 0
    decode_errors: int = 0
    bad_events: int = 0
    applied: int = 0
    """Batches applied (C stack)."""
    lookups: int = 0
    """Prompts (chains the chunk stored) looked up in all three stores and compared."""
    residencies: int = 0

    def add(self, other: Outcome) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class _Divergence:
    """Where the C path and the Python path may differ within a chunk (index/README.md)."""

    removed: dict[int, set[int]] = field(default_factory=dict)
    stored_bs: dict[int, dict[int, int]] = field(default_factory=dict)
    reset: set[int] = field(default_factory=set)

    def diverges(self, chunk: Sequence[tuple[int, Batch | bytes | None]]) -> bool:
        for sidx, item in chunk:
            if item is None:
                self.reset.add(sidx)
                continue
            if isinstance(item, bytes):
                try:
                    item = decode_payload(item)
                except WireError:
                    continue
            removed = self.removed.setdefault(sidx, set())
            stored = self.stored_bs.setdefault(sidx, {})
            for ev in item.events:
                if type(ev) is BlockRemoved:
                    removed.update(h for h in ev.block_hashes if type(h) is int)
                elif type(ev) is AllBlocksCleared:
                    self.reset.add(sidx)
                elif type(ev) is BlockStored:
                    p = ev.parent_block_hash
                    if p is not None and (
                        sidx in self.reset or p in removed or stored.get(p, ev.block_size) != ev.block_size
                    ):
                        return True
                    for h in ev.block_hashes:
                        if type(h) is int:
                            stored[h] = ev.block_size
        return False


def prompts(chunk: Sequence[tuple[int, Batch | bytes | None]], most: int = 2) -> list[bytes]:
    """Prompt keys built from the chunk's stored chains that start a prompt (lookups of real blocks)."""
    out = []
    for _, item in chunk:
        if isinstance(item, bytes):
            try:
                item = decode_payload(item)
            except WireError:
                continue
        for ev in item.events if item is not None else ():
            if type(ev) is not BlockStored or ev.parent_block_hash is not None:
                continue
            tokens, bs = ev.token_ids, ev.block_size
            if not 0 < bs <= 4096 or len(tokens) < bs:
                continue
            if all(type(t) is int and 0 <= t < 1 << 64 for t in tokens):
                out.append(_kvcore.prompt_keys(list(tokens), bs, BASE_ROOT, None))
                if len(out) == most:
                    return out
    return out


def lookups(store: Any, keys: Sequence[bytes]) -> list[Any]:
    """Each prompt's match on both sources (the dict store takes ints, the C store the uint64 bytes)."""
    if isinstance(store, DictPrefixStore):
        keys = [array("Q", k).tolist() for k in keys]  # type: ignore[misc]
    return [[(m.source, m.blocks, m.by_medium) for m in store.lookup(k, [0, 1])] for k in keys]


class Target:
    """Runs inputs; one ZeroMQ context for every stack (in-process sockets only)."""

    def __init__(self) -> None:
        quiet_logging()
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.total = Outcome()
        self.inputs = 0

    def run(self, data: bytes) -> Outcome:
        """One input through the three stacks; raises :class:`Finding` (or whatever escaped)."""
        messages = parse(data)
        stacks = [Stack(k, self.ctx) for k in ("c", "py", "dict")]
        try:
            return self._run(messages, stacks)
        finally:
            for s in stacks:
                s.close()

    def _run(self, messages: list[Message], stacks: list[Stack]) -> Outcome:
        c, _, ref = stacks
        out = Outcome(messages=len(messages), payloads=sum(m.frame_mode < 6 for m in messages))
        comparable = True
        for part in chunks(messages):
            out.chunks += 1
            fed = [s.feed(part) for s in stacks]
            if comparable and _Divergence().diverges(fed[1]):
                comparable = False  # from here on the C store may differ (it never may in vLLM streams)
            snaps = [snapshot(s.store) for s in stacks]
            counters = [s.counters() for s in stacks]
            keys = prompts(fed[1])
            found = [lookups(s.store, keys) for s in stacks]
            if snaps[1] != snaps[2] or counters[1] != counters[2] or found[1] != found[2]:
                diff = _diff(snaps[1:], counters[1:])
                raise Finding(f"python path: compact store != dict store\n{diff}\n{found[1:]}")
            if comparable:
                out.compared += 1
                out.lookups += len(keys)
                if snaps[0] != snaps[1] or counters[0] != counters[1] or found[0] != found[1]:
                    raise Finding(f"C path != Python path\n{_diff(snaps[:2], counters[:2])}\n{found[:2]}")
            else:
                out.not_compared += 1
                check_invariants(c.store, "c", snaps[0])
            check_invariants(ref.store, "dict", snaps[2])  # (py is equal to it, c too when compared)
        for row in c.counters():
            out.decode_errors += row["decode_errors"]
            out.bad_events += row["bad_events"]
            out.applied += row["batches"]
        out.residencies = c.store.total
        self.total.add(out)
        self.inputs += 1
        return out


def chunks(messages: Sequence[Message]) -> Iterator[list[Message]]:
    part: list[Message] = []
    for m in messages:
        part.append(m)
        if m.end_chunk:
            yield part
            part = []
    if part:
        yield part


def _diff(snaps: Sequence[dict[str, Any]], counters: Sequence[Any]) -> str:
    lines = []
    for k in snaps[0]:
        if snaps[0][k] != snaps[1][k]:
            lines.append(f"  {k}: {snaps[0][k]!r:.300}\n   vs {snaps[1][k]!r:.300}")
    if counters[0] != counters[1]:
        lines.append(f"  counters: {counters[0]}\n   vs {counters[1]}")
    return "\n".join(lines)


# ---- seeds: the captured vLLM frames ------------------------------------------------------------------

_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_STORED += ("extra_keys", "group_idx")
_REMOVED = ("block_hashes", "medium", "group_idx")


def to_legacy(payload: bytes) -> bytes:
    """A vLLM >= 0.24 payload in the <= 0.23 shape (tagged arrays)."""
    raw = msgspec.msgpack.decode(payload)
    events = []
    for ev in raw[1]:
        kind = ev["type"]
        names = _STORED if kind == "BlockStored" else _REMOVED if kind == "BlockRemoved" else ()
        events.append([kind, *[ev.get(n) for n in names]])
    raw[1] = events
    return msgspec.msgpack.encode(raw)


def capture_streams() -> Iterator[tuple[str, list[tuple[int, bytes]]]]:
    """(name, [(source, payload), ...]) per captured scenario, ranks mapped to sources 0 and 1."""
    for name in scenarios():
        capture = load(name)
        items = []
        for i, rank in enumerate(sorted(capture["ranks"])):
            items += [(i % 2, f[2]) for f in live_frames(capture, rank)]
        yield name, items


def seed_inputs() -> list[bytes]:
    """Fuzz inputs from every capture: as captured, in the legacy shape, one chunk or three per chunk."""
    out = []
    for _, items in capture_streams():
        for legacy in (False, True):
            for per_chunk in (1, 3):
                msgs = [
                    Message(s, 0, 0, to_legacy(p) if legacy else p, (k + 1) % per_chunk == 0)
                    for k, (s, p) in enumerate(items)
                ]
                out.append(encode(msgs))
    return out


# ---- atheris ---------------------------------------------------------------------------------------------


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main(argv: list[str]) -> None:
    """``python tests/kvfuzz.py CORPUS_DIR [libFuzzer flags]``: coverage-guided (atheris), with the
    Python of index/ and, when KVROUTER_KVCORE names an instrumented build, the C core covered.
    Progress (inputs, RSS, totals) goes to KVFUZZ_REPORT (and stderr) as a JSON line every
    KVFUZZ_EVERY inputs."""
    import json
    import time

    import atheris

    report = os.environ.get("KVFUZZ_REPORT")
    every = int(os.environ.get("KVFUZZ_EVERY", "50000"))
    target = Target()
    t0 = time.monotonic()

    def line() -> None:
        row = {"inputs": target.inputs, "seconds": round(time.monotonic() - t0, 1), "rss_kib": _rss_kib()}
        row |= vars(target.total) | {"kvcore": _KVCORE or "installed"}
        if report:
            with open(report, "a") as f:
                f.write(json.dumps(row) + "\n")
        print("kvfuzz", json.dumps(row), file=sys.stderr, flush=True)

    def one(data: bytes) -> None:
        target.run(data)
        if target.inputs % every == 0:
            line()

    # (libFuzzer ends the process with exit(): no Python exit hook runs; its final stats are printed)
    atheris.Setup(argv, one)
    atheris.Fuzz()


def write_seeds(folder: str) -> None:
    """The seed inputs as files (a libFuzzer corpus directory)."""
    import hashlib

    for data in seed_inputs():
        Path(folder, "seed-" + hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-seeds"]:
        write_seeds(sys.argv[2])
    else:
        main(sys.argv)


# ---- a seeded mutator (the bounded runs of make test; atheris does its own) --------------------------------


def mutate(data: bytes, rng: Any, pool: Sequence[bytes]) -> bytes:
    """A random variation of an input, mostly inside message bodies (so frames stay parseable)."""
    msgs = parse(data) or [Message(0, 0, 0, b"", True)]
    for _ in range(rng.randint(1, 4)):
        m = rng.choice(msgs)
        body = bytearray(m.body)
        op = rng.randrange(10)
        if op <= 2 and body:  # overwrite bytes, msgpack-interesting values often
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = (
                    rng.choice(_INTERESTING) if rng.random() < 0.5 else rng.randrange(256)
                )
        elif op == 3 and body:  # cut
            del body[rng.randrange(len(body)) :]
        elif op == 4:  # insert
            at = rng.randint(0, len(body))
            body[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        elif op == 5 and body:  # delete a range
            at = rng.randrange(len(body))
            del body[at : at + rng.randint(1, 16)]
        elif op == 6:  # another input's message in here
            other = parse(rng.choice(pool))
            if other:
                msgs.insert(rng.randint(0, len(msgs)), rng.choice(other))
        elif op == 7:  # duplicate a message
            msgs.insert(
                rng.randint(0, len(msgs)),
                Message(m.source, m.seq_mode, m.frame_mode, bytes(body), m.end_chunk),
            )
        elif op == 8:  # its control byte
            m.source, m.seq_mode = rng.randrange(2), rng.choice([0, 0, 0, 1, 2, 3])
            m.frame_mode, m.end_chunk = rng.choice([0, 0, 0, 0, 5, 6, 7]), rng.random() < 0.4
        elif body:  # copy a slice of the body elsewhere in it
            a = rng.randrange(len(body))
            piece = body[a : a + rng.randint(1, 32)]
            at = rng.randrange(len(body))
            body[at:at] = piece
        m.body = bytes(body[:65535])
    return encode(msgs)


_INTERESTING = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC5, 0xC6]
_INTERESTING += [0xC7, 0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD3, 0xD4, 0xD8, 0xD9, 0xDB, 0xDC]
_INTERESTING += [0xDD, 0xDE, 0xDF, 0xE0, 0xFF, 0x01, 0x02, 0x04, 0x10]
