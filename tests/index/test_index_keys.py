"""Our block keys: the vectorised and scalar paths agree, chains commit to the prefix, salts separate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.keys import block_contents, chain, chain_vec, extra_hash, lora_root, prompt_keys

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, block_size=st.sampled_from([1, 2, 4, 16, 64]), lora=st.none() | st.text(max_size=8))
def test_vectorised_chain_equals_scalar_chain(tokens: list[int], block_size: int, lora: str | None) -> None:
    contents = block_contents(tokens, block_size)
    root = lora_root(lora)
    assert chain(root, contents.tolist()) == chain_vec(root, contents).tolist()
    assert prompt_keys(tokens, block_size, lora_name=lora) == chain(root, contents.tolist())


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st, cut=st.integers(min_value=0, max_value=300))
def test_extending_a_parent_equals_hashing_the_whole_prompt(tokens: list[int], cut: int) -> None:
    bs = 4
    keys = prompt_keys(tokens, bs)
    k = min(cut // bs, len(keys))
    head = keys[:k]
    parent = head[-1] if head else lora_root(None)
    tail = chain(parent, block_contents(tokens[k * bs :], bs).tolist())
    assert head + tail == keys


def test_partial_tail_is_ignored_and_prefixes_share_keys() -> None:
    t = list(range(100))
    assert len(prompt_keys(t, 16)) == 6
    assert prompt_keys(t[:48], 16) == prompt_keys(t, 16)[:3]
    assert prompt_keys(t[:15], 16) == []


def test_chain_commits_to_earlier_blocks() -> None:
    a = prompt_keys([1, 2, 3, 4, 5, 6], 2)
    b = prompt_keys([9, 2, 3, 4, 5, 6], 2)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_repeated_blocks_get_distinct_keys_at_every_depth() -> None:
    """All-zero blocks hash to content 0: the chain must still give each depth its own key."""
    for token in (0, 1):
        keys = prompt_keys([token] * 64, 16)
        assert len(set(keys)) == 4
    assert len(set(prompt_keys([0] * 64, 16, lora_name="x"))) == 4


def test_position_inside_a_block_matters() -> None:
    assert prompt_keys([1, 2], 2) != prompt_keys([2, 1], 2)


def test_lora_and_cache_salt_separate_tenants() -> None:
    t = list(range(64))
    base = prompt_keys(t, 16)
    assert set(base).isdisjoint(prompt_keys(t, 16, lora_name="sql"))
    assert prompt_keys(t, 16, lora_name="sql") != prompt_keys(t, 16, lora_name="chat")
    salted = prompt_keys(t, 16, extra_keys={0: ["tenant-42"]})
    assert set(base).isdisjoint(salted)  # the salt on block 0 changes every later key through the chain
    assert extra_hash(["tenant-42"]) != extra_hash(["tenant-43"])


def test_bad_tokens_and_block_sizes() -> None:
    with pytest.raises(ValueError):
        prompt_keys([-1] * 16, 16)
    with pytest.raises(ValueError):
        prompt_keys([1.5] * 16, 16)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        prompt_keys([1] * 16, 0)


def test_keys_are_stable_across_processes() -> None:
    """Keys must not depend on PYTHONHASHSEED or process state: pin one value."""
    assert prompt_keys(list(range(16)), 16) == [prompt_keys(list(range(16)), 16)[0]]
    import subprocess
    import sys

    code = "from index.keys import prompt_keys; print(prompt_keys(list(range(32)), 16, lora_name='x'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("0", "123")
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str(prompt_keys(list(range(32)), 16, lora_name="x"))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=80),
    block_size=st.sampled_from([1, 3, 16]),
    lora=st.none() | st.text(max_size=8),
    salted=st.sets(st.integers(min_value=0, max_value=5), max_size=3),
)
def test_compiled_prompt_keys_equal_the_numpy_reference(
    tokens: list[int], block_size: int, lora: str | None, salted: set[int]
) -> None:
    """prompt_keys (one C pass over the token list) against numpy's content hash and chain."""
    extra = {i: ["salt", i] for i in salted} or None
    fast = prompt_keys(tokens, block_size, lora_name=lora, extra_keys=extra)
    m = block_contents(tokens, block_size)
    for i, items in (extra or {}).items():
        if i < len(m):
            m[i] ^= np.uint64(extra_hash(items))
    assert fast == chain_vec(lora_root(lora), m).tolist()


def test_prompt_keys_reject_bad_tokens() -> None:
    for bad in ([-1] * 16, [2**64] * 16, ["a"] * 16, [1.5] * 16):
        with pytest.raises(ValueError):
            prompt_keys(bad, 16)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 4, 16]),
    salted=st.booleans(),
)
def test_prompt_keys_both_equals_prompt_keys(tokens: list[int], block_size: int, salted: bool) -> None:
    from index.keys import prompt_keys_both

    extra = {0: ["salt"]} if salted else None
    as_list, as_array = prompt_keys_both(tokens, block_size, lora_name="x", extra_keys=extra)
    assert as_list == prompt_keys(tokens, block_size, lora_name="x", extra_keys=extra)
    assert memoryview(as_array).cast("Q").tolist() == as_list
