"""Workload generator and trace loaders: determinism, conversation growth, id-to-token mapping, bounds."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sim.traces import README_BOUNDS, infinite_hit_ratio, load_mooncake, load_sessions, load_trace, resolve
from sim.workload import Request, TracePrompt, WorkloadConfig, demo_config, generate, summary, with_answers

SMALL = WorkloadConfig(seed=3, duration_s=20.0, session_rate=1.0, doc_rate=2.0, num_docs=5)


def _plain(reqs: list[Request]) -> list[tuple[Any, ...]]:
    return [
        (r.at_s, r.session, r.turn, r.think_s, r.max_tokens, r.kind, json.dumps(r.messages)) for r in reqs
    ]


def test_generation_is_deterministic_and_seeded() -> None:
    a, b = generate(SMALL), generate(SMALL)
    assert _plain(a) == _plain(b)
    other = generate(WorkloadConfig(seed=4, duration_s=20.0, session_rate=1.0, doc_rate=2.0, num_docs=5))
    assert _plain(other) != _plain(a)
    assert [r.at_s for r in a] == sorted(r.at_s for r in a)
    kinds = Counter(r.kind for r in a)
    assert kinds["chat"] > 10 and kinds["doc"] > 10


def test_conversations_resend_their_whole_history() -> None:
    by_session: dict[str, list[Request]] = {}
    for r in generate(SMALL):
        by_session.setdefault(r.session, []).append(r)
    chats = [turns for s, turns in by_session.items() if s.startswith("chat-")]
    assert any(len(t) >= 3 for t in chats)
    for turns in chats:
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert turns[0].think_s is None and turns[0].messages is not None
        assert turns[0].messages[0]["role"] == "system"
        for prev, cur in itertools.pairwise(turns):
            assert prev.messages is not None and cur.messages is not None
            n = len(prev.messages)
            assert cur.messages[:n] == prev.messages  # the whole previous prompt is resent ...
            assert cur.messages[n]["role"] == "assistant"  # ... then the answer, then a new question
            assert cur.messages[n + 1]["role"] == "user" and len(cur.messages) == n + 2
            assert cur.think_s is not None and cur.think_s >= 0
            assert cur.at_s >= prev.at_s


def test_shared_system_prompts_and_popular_documents() -> None:
    reqs = generate(WorkloadConfig(seed=1, duration_s=60.0, doc_rate=3.0, num_docs=6, doc_zipf=1.2))
    systems = {r.messages[0]["content"] for r in reqs if r.kind == "chat" and r.messages}
    assert len(systems) == 3  # the default three system prompts, all used
    lengths = sorted(len(s) for s in systems)
    assert lengths[0] * 2 < lengths[-1]  # of clearly different lengths
    docs = Counter(int(r.meta["doc"]) for r in reqs if r.kind == "doc")
    assert docs.most_common(1)[0][0] == 0  # Zipf: the first document is the most popular
    assert docs[0] > docs.get(5, 0)
    doc_req = next(r for r in reqs if r.kind == "doc" and r.meta["doc"] == 0.0)
    assert doc_req.messages is not None and doc_req.messages[-1]["content"].startswith("Document 0.")


def test_with_answers_replaces_known_answers_only() -> None:
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "stand-in 0"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "stand-in 1"},
        {"role": "user", "content": "u2"},
    ]
    out = with_answers(msgs, ["real 0", None])
    assert [m["content"] for m in out] == ["s", "u0", "real 0", "u1", "stand-in 1", "u2"]
    assert msgs[2]["content"] == "stand-in 0"  # not mutated


def test_demo_configs_are_small() -> None:
    quick = generate(demo_config(quick=True))
    full = generate(demo_config())
    assert 40 <= summary(quick)["requests"] < 90
    assert 60 <= summary(full)["requests"] <= 400
    assert summary(full)["span_s"] < 45


# ---- trace prompts ------------------------------------------------------------------------------------


def _tp(ns: int, ids: list[int], n_tokens: int, tpb: int = 8, **kw: Any) -> TracePrompt:
    return TracePrompt(ns, np.asarray(ids, dtype=np.int64), n_tokens, tpb, **kw)


def test_trace_blocks_map_to_fixed_tokens() -> None:
    a = _tp(0, [1, 2, 3], 24).token_ids()
    b = _tp(0, [1, 2, 4], 24).token_ids()
    assert len(a) == 24 and a == _tp(0, [1, 2, 3], 24).token_ids()
    assert a[:16] == b[:16] and a[16:] != b[16:]  # equal ids -> equal tokens, and only those
    assert _tp(0, [2], 8).token_ids() == a[8:16]  # a block's tokens do not depend on its position
    assert _tp(1, [1], 8).token_ids() != a[:8]  # namespaces (session files) never share
    assert all(5 <= t < 2048 for t in a)
    part = _tp(0, [1, 2, 3], 19)
    assert part.token_ids() == a[:19] and part.length == 19
    tail = _tp(0, [1, 2], 16, tail_tokens=5, tail_seed=77)
    ids = tail.token_ids()
    assert ids[:16] == a[:16] and len(ids) == 21 == tail.length
    assert ids[16:] != _tp(0, [1, 2], 16, tail_tokens=5, tail_seed=78).token_ids()[16:]


# ---- loaders on tiny fixtures -------------------------------------------------------------------------


def _write_mooncake(path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1600, "output_length": 20, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 1500, "input_length": 512, "output_length": 5, "hash_ids": [0]},
    ]
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for rec in lines:
            fh.write(json.dumps(rec) + "\n")


def test_mooncake_loader(tmp_path: Path) -> None:
    path = tmp_path / "tiny_trace.jsonl.gz"
    _write_mooncake(path)
    trace = load_mooncake(path, tokens_per_block=64)
    assert [r.at_s for r in trace.requests] == [0.0, 0.5, 1.5]
    assert [r.max_tokens for r in trace.requests] == [10, 20, 5]
    assert trace.scale == 8
    # 1100 tokens = 2 full blocks + 76 tokens -> 2 * 64 + ceil(76 / 8) = 138 scaled tokens
    lengths = [len(r.token_ids() or []) for r in trace.requests]
    assert lengths == [138, 3 * 64 + 8, 64]
    t0, t1, t2 = (r.token_ids() or [] for r in trace.requests)
    assert t0[:128] == t1[:128] and t0[128:] != t1[128:138] and t2 == t0[:64]
    # blocks seen before: 0 + 2 (ids 0, 1) + 1 (id 0) out of 3 + 4 + 1
    assert trace.infinite_hit_ratio() == pytest.approx(3 / 8)
    exact = load_mooncake(path)
    assert len(exact.requests[0].token_ids() or []) == 1100 and exact.scale == 1
    assert len(load_mooncake(path, limit=2).requests) == 2


def _session(sid: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": sid, "block_size": 64, "hash_id_scope": "local", "requests": requests}


def _write_sessions(path: Path) -> None:
    s1 = _session(
        "trace_0001",
        [
            {"t": 0.0, "type": "n", "in": 130, "out": 7, "hash_ids": [1, 2]},
            {"t": 5.0, "type": "n", "in": 200, "out": 3, "hash_ids": [1, 2, 3]},
            {
                "t": 6.0,
                "type": "subagent",
                "requests": [
                    {"t": 0.0, "type": "n", "in": 64, "out": 2, "hash_ids": [9]},
                    {"t": 1.0, "type": "n", "in": 128, "out": 2, "hash_ids": [9, 10]},
                ],
            },
            {"t": 1000.0, "type": "n", "in": 256, "out": 4, "hash_ids": [1, 2, 3, 4]},
        ],
    )
    s2 = _session("trace_0002", [{"t": 0.0, "type": "n", "in": 128, "out": 1, "hash_ids": [1, 2]}])
    with tarfile.open(path, "w:gz") as tf:
        for doc in (s1, s2):
            raw = json.dumps(doc).encode()
            info = tarfile.TarInfo(f"traces/{doc['id']}.json")
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))


def test_sessions_loader(tmp_path: Path) -> None:
    path = tmp_path / "tiny_sessions.tar.gz"
    _write_sessions(path)
    trace = load_sessions([path], tokens_per_block=16, session_rate=0.0, max_gap_s=60.0)
    assert trace.sessions == 2 and trace.scale == 4
    s1 = [r for r in trace.requests if r.session == "trace_0001"]
    assert [r.at_s for r in s1] == [0.0, 5.0, 6.0, 7.0, 66.0]  # subagent nested at 6 s; 994 s gap clamped
    first, second = (r.token_ids() or [] for r in s1[:2])
    # 130 tokens = 2 blocks (32 scaled tokens) + 2 private tokens (ceil(2 / 4) = 1 scaled token)
    assert len(first) == 33 and first[:32] == second[:32]
    s2 = next(r for r in trace.requests if r.session == "trace_0002")
    assert (s2.token_ids() or [])[:32] != first[:32]  # ids are local to a file
    # seen before: s1: 0 + 2 + (0 + 1) + 3 = 6 of 2 + 3 + 1 + 2 + 4 = 12; s2: 0 of 2
    assert trace.infinite_hit_ratio() == pytest.approx(6 / 14)
    assert len(load_sessions([path], max_sessions=1, session_rate=0.0).requests) == 5
    assert len(load_sessions([path], limit=3, session_rate=0.0).requests) == 3
    # Poisson session starts are seeded
    a = load_sessions([path], session_rate=0.5, seed=1)
    b = load_sessions([path], session_rate=0.5, seed=1)
    assert [r.at_s for r in a.requests] == [r.at_s for r in b.requests]
    assert load_trace(str(path), session_rate=0.0).sessions == 2


def test_infinite_bound_of_plain_requests_is_zero() -> None:
    assert infinite_hit_ratio([Request(at_s=0.0, session="x", prompt_token_ids=[1, 2])]) == 0.0


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_shared_mooncake_traces_match_the_readme(name: str) -> None:
    paths = resolve(name)
    if not all(p.exists() for p in paths):
        pytest.skip(f"shared trace {paths[0]} not present")
    trace = load_trace(name)
    assert trace.infinite_hit_ratio() == pytest.approx(README_BOUNDS[name], abs=5e-4)
    assert len(trace.requests) == {"conversation": 12_031, "synthetic": 3_993}[name]
