"""ejk_lite.masking against a brute-force token mask written here in NumPy.

A tile must be listed iff at least one (query, key) pair in it is visible, and full iff every pair is
(pairs past the ends of the sequences do not count). Every builder -- token rules (documents,
positions, causal, windows), token-level attention masks, block layouts, and their intersections and
unions -- is checked on random inputs (hypothesis): the tile kinds, the padded lists (counts and
ascending indices, and the transposed lists a dK/dV backward walks) and ``token_mask()``.

Speed: built eagerly, the builder's ``lax.cond`` (sorted keys or not) is traced from fresh closures
on every call, so XLA compiles both branches again each time (seconds on CPU). The random tests
therefore run the builder under ``jax.disable_jit()`` -- the same jnp operations, dispatched one by
one and cached per shape -- on a few fixed geometries; the compiled path (both branches of the cond,
under ``jax.jit``) has tests of its own below.
"""

import functools
import importlib

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ejk_lite import BlockMask, intersection, make_block_mask, union
from ejk_lite.masking import EMPTY, FULL, PARTIAL

B, H = 2, 2  # batch rows and heads of the random masks

# (T, S, q_block, kv_block): self- and cross-attention, lengths that are not multiples of the
# blocks, a block larger than its sequence, blocks of 1. Few on purpose: each new shape compiles.
GEOMETRIES = [
    (37, 37, 8, 16),
    (37, 37, 32, 4),
    (50, 23, 16, 4),
    (12, 9, 1, 2),
]
# Other block sizes for the same lengths (BlockMask.with_blocks); each other's, to share compiles.
OTHER_BLOCKS = {(37, 37): [(32, 4), (8, 16)], (50, 23): [(16, 4)], (12, 9): [(1, 2)]}

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------
# The brute force: the token mask pair by pair, then tile kinds by slicing.
# ----------------------------------------------------------------------------------------------


def brute_visible(T, S, *, blocks=None, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
                  causal=False, sliding_window=None, attention_mask=None, layout=None, layout_block=None,
                  combine="and"):
    """Dense boolean ``[B, H, T, S]`` (or with leading size-1 axes) from the definitions."""
    vis = np.ones((1, 1, T, S), bool)
    # Positions are read by causal and the window only: alone they are no rule (a layout then
    # stands alone, even with combine="or"), as make_block_mask documents.
    rule = (any(x is not None for x in (q_segment_ids, kv_segment_ids, attention_mask))
            or causal or sliding_window is not None)
    if q_segment_ids is not None:
        qs, ks = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
        vis = vis & (qs[:, None, :, None] == ks[:, None, None, :])
    qp = np.arange(T)[None] if q_positions is None else np.asarray(q_positions)
    kp = np.arange(S)[None] if kv_positions is None else np.asarray(kv_positions)
    d = kp.astype(np.int64)[:, None, None, :] - qp.astype(np.int64)[:, None, :, None]  # kv - q
    if causal:
        vis = vis & (d <= 0)
    if sliding_window is not None:
        left, right = ((sliding_window, sliding_window) if isinstance(sliding_window, int)
                       else sliding_window)
        vis = vis & (d >= -left) & (d <= right)
    if attention_mask is not None:
        vis = vis & (np.asarray(attention_mask) != 0)
    if layout is not None:
        lay = np.asarray(layout) != 0
        lay = lay[None] if lay.ndim == 2 else lay
        lq, lk = layout_block if layout_block is not None else blocks  # default: the blocks
        tokens = lay[:, np.arange(T) // lq][:, :, np.arange(S) // lk][None]  # [1, H or 1, T, S]
        if not rule:
            vis = tokens
        else:
            vis = (vis & tokens) if combine == "and" else (vis | tokens)
    return vis


def brute_kinds(vis, bq, bk):
    """Tile kinds ``[..., nQ, nK]`` of a dense mask: slices stop at the ends, so padding never counts."""
    *lead, T, S = vis.shape
    nQ, nK = -(-T // bq), -(-S // bk)
    kinds = np.zeros((*lead, nQ, nK), np.int8)
    for i in range(nQ):
        for j in range(nK):
            tile = vis[..., i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            kinds[..., i, j] = np.where(tile.all(axis=(-2, -1)), FULL,
                                        np.where(tile.any(axis=(-2, -1)), PARTIAL, EMPTY))
    return kinds


def check_list(count, index, kinds, kind, what):
    count, index = np.asarray(count), np.asarray(index)
    assert count.dtype == np.int32 and index.dtype == np.int32, what
    assert count.shape == kinds.shape[:-1] and index.shape == kinds.shape, what
    selected = kinds == kind
    np.testing.assert_array_equal(count, selected.sum(-1), err_msg=f"{what} counts")
    for at in np.ndindex(kinds.shape[:-1]):
        expected = np.flatnonzero(selected[at])  # ascending
        np.testing.assert_array_equal(index[at][:len(expected)], expected, err_msg=f"{what} {at}")


def check_mask(mask, vis, expected_kinds=None):
    """Kinds, the four padded lists and the token mask of ``mask`` against the dense ``vis``. The
    kinds must be ``expected_kinds`` if given (two rules combined: the tile-by-tile combination of
    their kinds), else exact; they must be sound anyway (listed where a pair is visible, full only
    where every pair is)."""
    assert isinstance(mask, BlockMask)
    T, S = vis.shape[-2:]
    assert (mask.q_len, mask.kv_len) == (T, S)
    kinds = np.asarray(mask.kinds)
    assert kinds.dtype == np.int8
    Bm, Hm = kinds.shape[:2]
    full_shape = (max(Bm, vis.shape[0]), max(Hm, vis.shape[1]))
    exact = brute_kinds(np.broadcast_to(vis, (*full_shape, T, S)), mask.q_block, mask.kv_block)
    expected = exact if expected_kinds is None else np.broadcast_to(expected_kinds, exact.shape)
    np.testing.assert_array_equal(np.broadcast_to(kinds, expected.shape), expected, err_msg="kinds")
    got = np.broadcast_to(kinds, exact.shape)
    assert np.all((got != EMPTY) | (exact == EMPTY)) and np.all((got != FULL) | (exact == FULL))
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(mask.token_mask()), (*full_shape, T, S)),
                                  np.broadcast_to(vis, (*full_shape, T, S)), err_msg="token_mask")
    transposed = kinds.swapaxes(-1, -2)
    check_list(mask.partial_count, mask.partial_index, kinds, PARTIAL, "partial")
    check_list(mask.full_count, mask.full_index, kinds, FULL, "full")
    check_list(mask.t_partial_count, mask.t_partial_index, transposed, PARTIAL, "t_partial")
    check_list(mask.t_full_count, mask.t_full_index, transposed, FULL, "t_full")


def build_and_check(T, S, bq, bk, **kwargs):
    with jax.disable_jit():
        mask = make_block_mask(T, S, q_block=bq, kv_block=bk, **kwargs)
        check_mask(mask, brute_visible(T, S, **kwargs))
    return mask


# ----------------------------------------------------------------------------------------------
# Random inputs: choices drawn by hypothesis (so they shrink), arrays from a seeded NumPy generator.
# ----------------------------------------------------------------------------------------------


def document_ids(rng, n):
    """Sorted segment ids of packed documents, with empty and one-token documents."""
    lengths = []
    while sum(lengths) < n:
        r = rng.random()
        length = 0 if r < 0.15 else 1 if r < 0.35 else int(rng.integers(2, n + 1))
        lengths.append(min(length, n - sum(lengths)))
    return np.repeat(np.arange(len(lengths)), lengths)


def restarting_positions(ids):
    starts = np.r_[0, np.flatnonzero(np.diff(ids)) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, len(ids)]))
    return np.arange(len(ids)) - first


@st.composite
def rule_kwargs(draw, T, S):
    """Segments, positions, causal and window: any combination, possibly none."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kw = {}
    docs = draw(st.sampled_from(["none", "sorted", "sorted", "unsorted"]))
    if docs != "none":
        q_ids = np.stack([document_ids(rng, T) for _ in range(B)])
        shared = T == S and draw(st.booleans())
        kv_ids = q_ids if shared else np.stack([document_ids(rng, S) for _ in range(B)])
        if docs == "unsorted":
            q_ids, kv_ids = rng.integers(0, 3, (B, T)), rng.integers(0, 3, (B, S))
        kw.update(q_segment_ids=q_ids.astype(np.int32), kv_segment_ids=kv_ids.astype(np.int32))
    for name, n, ids in (("q_positions", T, kw.get("q_segment_ids")),
                         ("kv_positions", S, kw.get("kv_segment_ids"))):
        kind = draw(st.sampled_from(["default", "restart", "offset", "random"]))
        if kind == "restart":
            pos = np.stack([restarting_positions(row) for row in ids]) if ids is not None \
                else np.tile(np.arange(n), (B, 1))
        elif kind == "offset":
            pos = np.arange(n)[None] + rng.integers(-5, 30, (B, 1))
        elif kind == "random":
            pos = rng.integers(-30, 60, (B, n))
        else:
            continue
        kw[name] = pos.astype(np.int32)
    kw["causal"] = draw(st.booleans())
    kw["sliding_window"] = draw(st.one_of(
        st.none(), st.integers(0, 6), st.tuples(st.integers(0, 6), st.integers(0, 6)),
        st.just((1000, 0))))
    return kw


@st.composite
def token_masks(draw, T, S):
    """``[B or 1, H or 1, T, S]``: padding, prefix-LM, random (bool or 0/1 integers)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Bm, Hm = draw(st.sampled_from([1, B])), draw(st.sampled_from([1, H]))
    kind = draw(st.sampled_from(["padding", "prefix", "random", "all", "nothing"]))
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    masks = np.zeros((Bm, Hm, T, S), bool)
    for b in range(Bm):
        for h in range(Hm):
            if kind == "padding":  # keys past a length, and queries past another (rows with nothing)
                masks[b, h] = (s < rng.integers(0, S + 1)) & (t < rng.integers(T // 2, T + 1))
            elif kind == "prefix":  # bidirectional prefix, causal after it
                masks[b, h] = (s < rng.integers(0, S + 1)) | (s <= t)
            elif kind == "random":
                masks[b, h] = rng.random((T, S)) < draw(st.sampled_from([0.03, 0.5, 0.97]))
            else:
                masks[b, h] = kind == "all"
    dtype = draw(st.sampled_from([np.bool_, np.int32, np.int8]))
    return masks.astype(dtype)


def layout_pattern(rng, kind, heads, nq, nk):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    out = []
    for _ in range(heads):
        if kind == "strided":
            stride = int(rng.integers(2, 4))
            out.append(((i - j) % stride == 0) | (j % stride == stride - 1))
        elif kind == "global_local":
            out.append((i < 1) | (j < 1) | (np.abs(i - j) <= int(rng.integers(0, 2))))
        else:
            out.append(rng.random((nq, nk)) < 0.4)
    return np.stack(out)


@st.composite
def layouts(draw, T, S, bq, bk):
    """A block layout ``[nLQ, nLK]`` or ``[H or 1, nLQ, nLK]`` at a grain no finer than the blocks."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lq = bq * 2 ** draw(st.integers(0, 2))
    lk = bk * 2 ** draw(st.integers(0, 2))
    nq, nk = -(-T // lq), -(-S // lk)
    rank = draw(st.sampled_from([2, 3, 3]))
    heads = 1 if rank == 2 else draw(st.sampled_from([1, H]))
    kind = draw(st.sampled_from(["strided", "global_local", "random"]))
    layout = layout_pattern(rng, kind, heads, nq, nk)
    layout = layout[0] if rank == 2 else layout
    if draw(st.booleans()):
        layout = layout.astype(np.int32)
    return layout, (lq, lk)


# ----------------------------------------------------------------------------------------------
# Exactness of each builder.
# ----------------------------------------------------------------------------------------------


@settings(max_examples=30, **SETTINGS)
@given(data=st.data())
def test_token_rule_builder_exact(data):
    T, S, bq, bk = data.draw(st.sampled_from(GEOMETRIES), label="geometry")
    kw = data.draw(rule_kwargs(T, S), label="rule")
    build_and_check(T, S, bq, bk, **kw)


@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_attention_mask_builder_exact(data):
    T, S, bq, bk = data.draw(st.sampled_from(GEOMETRIES), label="geometry")
    kw = data.draw(rule_kwargs(T, S), label="rule") if data.draw(st.booleans(), label="with rule") else {}
    kw["attention_mask"] = data.draw(token_masks(T, S), label="attention_mask")
    build_and_check(T, S, bq, bk, **kw)


@settings(max_examples=25, **SETTINGS)
@given(data=st.data())
def test_layout_builder_exact(data):
    T, S, bq, bk = data.draw(st.sampled_from(GEOMETRIES), label="geometry")
    kw = {}
    rule = data.draw(st.sampled_from(["none", "rule", "rule", "attention_mask"]), label="rule kind")
    if rule == "rule":
        kw = data.draw(rule_kwargs(T, S), label="rule")
    elif rule == "attention_mask":
        kw["attention_mask"] = data.draw(token_masks(T, S), label="attention_mask")
    kw["layout"], kw["layout_block"] = data.draw(layouts(T, S, bq, bk), label="layout")
    kw["combine"] = data.draw(st.sampled_from(["and", "or"]), label="combine")
    build_and_check(T, S, bq, bk, **kw)


def test_positions_alone_are_no_rule_beside_a_layout():
    # Found by test_layout_builder_exact on the H100 (a draw the CPU runs had not made): with
    # combine="or", positions given without causal or a window must leave the layout alone,
    # not count as a rule that sees every pair.
    T, S, bq, bk = 37, 37, 8, 16
    layout = np.array([[1, 0, 1], [0, 1, 1], [0, 0, 1], [1, 0, 1], [0, 1, 1]], bool)
    positions = np.tile(np.arange(S, dtype=np.int32), (2, 1))
    for combine in ("and", "or"):
        kw = dict(layout=layout, layout_block=(bq, bk), combine=combine)
        alone = make_block_mask(T, S, q_block=bq, kv_block=bk, **kw)
        with_positions = make_block_mask(T, S, q_block=bq, kv_block=bk, kv_positions=positions,
                                         **kw)
        np.testing.assert_array_equal(np.asarray(with_positions.kinds), np.asarray(alone.kinds))
        check_mask(with_positions, brute_visible(T, S, kv_positions=positions, **kw))


@pytest.mark.parametrize("case", ["one_token_docs", "q_doc_missing_in_kv", "window_0", "no_rule",
                                  "all_masked", "single_token", "empty_lengths"])
def test_builder_edge_cases(case, rng):
    T, S, bq, bk = 37, 37, 8, 16
    kw = {}
    if case == "one_token_docs":  # every token its own document: only the diagonal is visible
        ids = np.tile(np.arange(T, dtype=np.int32), (B, 1))
        kw = dict(q_segment_ids=ids, kv_segment_ids=ids, causal=True)
    elif case == "q_doc_missing_in_kv":  # T != S; documents 1 and 3 have no keys (rows see nothing)
        T, S, bq, bk = 50, 23, 16, 4
        kw = dict(q_segment_ids=np.repeat([[0, 1, 2, 3]], [10, 15, 5, 20], axis=1).astype(np.int32),
                  kv_segment_ids=np.repeat([[0, 2, 4]], [7, 7, 9], axis=1).astype(np.int32))
    elif case == "window_0":
        kw = dict(sliding_window=0)
    elif case == "all_masked":
        kw = dict(attention_mask=np.zeros((1, 1, T, S), bool))
    elif case == "single_token":
        T, S, bq, bk = 1, 1, 16, 16
        kw = dict(causal=True, sliding_window=(0, 0))
    elif case == "empty_lengths":
        for T, S in ((0, 9), (9, 0), (0, 0)):
            build_and_check(T, S, 4, 4, causal=True)
        return
    mask = build_and_check(T, S, bq, bk, **kw)
    kinds = np.asarray(mask.kinds)
    if case == "no_rule":
        assert mask.rule is None and np.all(kinds == FULL)
    if case == "all_masked":
        assert np.all(kinds == EMPTY) and not np.any(mask.partial_count) and not np.any(mask.full_count)
    if case == "single_token":
        assert kinds.shape[-2:] == (1, 1) and np.all(kinds == FULL)


def test_wide_segment_ids_are_exact(rng):
    """int64 / uint32 ids: equality decides, for any values (ids equal modulo 2**32 stay apart), and
    positions outside the int32 dtype but inside (-2**30, 2**30) are fine as int64."""
    T, S, bq, bk = 50, 23, 16, 4
    rule = random_rule(rng, T, S)
    q_ids = rule["q_segment_ids"].astype(np.int64) * 2**32 - 3 * 2**40
    kv_ids = rule["kv_segment_ids"].astype(np.int64) * 2**32 - 3 * 2**40
    kw = dict(rule, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=True,
              q_positions=rule["q_positions"].astype(np.int64))
    mask = build_and_check(T, S, bq, bk, **kw)
    assert mask.rule.q_segment_ids.dtype == np.int32
    unsigned = dict(kw, q_segment_ids=rule["q_segment_ids"].astype(np.uint32) + np.uint32(2**31),
                    kv_segment_ids=rule["kv_segment_ids"].astype(np.uint32) + np.uint32(2**31))
    build_and_check(T, S, bq, bk, **unsigned)


# ----------------------------------------------------------------------------------------------
# Other block sizes, composition.
# ----------------------------------------------------------------------------------------------


def mask_arrays(mask):
    return [np.asarray(x) for x in (mask.kinds, mask.partial_count, mask.partial_index, mask.full_count,
                                    mask.full_index, mask.t_partial_count, mask.t_partial_index,
                                    mask.t_full_count, mask.t_full_index)]


@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_with_blocks_equals_building_directly(data):
    T, S, bq, bk = data.draw(st.sampled_from(GEOMETRIES[:2]), label="geometry")
    bq2, bk2 = data.draw(st.sampled_from(OTHER_BLOCKS[T, S]), label="other blocks")
    kw = data.draw(rule_kwargs(T, S), label="rule")
    if data.draw(st.booleans(), label="with attention_mask"):
        kw["attention_mask"] = data.draw(token_masks(T, S), label="attention_mask")
    if data.draw(st.booleans(), label="with layout"):
        kw["layout"], kw["layout_block"] = data.draw(
            layouts(T, S, max(bq, bq2), max(bk, bk2)), label="layout")
        kw["combine"] = data.draw(st.sampled_from(["and", "or"]), label="combine")
    with jax.disable_jit():
        mask = make_block_mask(T, S, q_block=bq, kv_block=bk, **kw)
        other = mask.with_blocks(bq2, bk2)
        direct = make_block_mask(T, S, q_block=bq2, kv_block=bk2, **kw)
        assert (other.q_block, other.kv_block) == (bq2, bk2)
        for a, b in zip(mask_arrays(other), mask_arrays(direct)):
            np.testing.assert_array_equal(np.broadcast_to(a, b.shape), b)
        check_mask(other, brute_visible(T, S, **kw))
        assert mask.with_blocks(bq, bk) is mask


def test_keeping_stores_other_block_sizes(monkeypatch):
    """BlockMask.keeping builds the lists at other block sizes once: with_blocks then returns them
    (equal to a direct build, with the mask's rule) and builds nothing (a spy on the builder
    fails otherwise); the sizes are checked."""
    rng = np.random.default_rng(0)
    T = 70
    ids = np.stack([document_ids(rng, T) for _ in range(B)]).astype(np.int32)
    kw = dict(q_segment_ids=ids, kv_segment_ids=ids, causal=True, sliding_window=20)
    mask = make_block_mask(T, T, q_block=32, kv_block=32, **kw)
    kept = mask.keeping((16, 16), (32, 16), (16, 16), (32, 32))  # repeats and its own: skipped
    assert [(m.q_block, m.kv_block) for m in kept.kept] == [(16, 16), (32, 16)]
    assert all(m.rule is None and m.layout is None for m in kept.kept)
    monkeypatch.setattr(importlib.import_module("ejk_lite.masking"), "build_block_mask",
                        lambda *a, **k: pytest.fail("with_blocks built a mask it keeps"))
    for bq, bk in ((16, 16), (32, 16)):
        other = kept.with_blocks(bq, bk)
        assert (other.q_block, other.kv_block) == (bq, bk) and other.rule is mask.rule
        monkeypatch.undo()
        direct = make_block_mask(T, T, q_block=bq, kv_block=bk, **kw)
        for a, b in zip(mask_arrays(other), mask_arrays(direct)):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="q_block"):
        mask.keeping((24, 16))
    with pytest.raises(ValueError, match="pairs"):
        mask.keeping(16)


def test_with_blocks_coarser_than_layout_is_an_error():
    layout = np.eye(3, dtype=bool)
    mask = make_block_mask(37, 37, q_block=8, kv_block=16, layout=layout, layout_block=16)
    with pytest.raises(ValueError, match="layout"):
        mask.with_blocks(32, 16)


def random_rule(rng, T, S):
    ids_q = np.stack([document_ids(rng, T) for _ in range(B)]).astype(np.int32)
    ids_k = ids_q if T == S else np.stack([document_ids(rng, S) for _ in range(B)]).astype(np.int32)
    pos_q = np.stack([restarting_positions(r) for r in ids_q]).astype(np.int32)
    pos_k = np.stack([restarting_positions(r) for r in ids_k]).astype(np.int32)
    return dict(q_segment_ids=ids_q, kv_segment_ids=ids_k, q_positions=pos_q, kv_positions=pos_k)


def combination_operands(rng, case, T, S, bq, bk):
    """Two sets of builder arguments for ``case``."""
    nq, nk = -(-T // bq), -(-S // bk)
    if case == "layout_and_rule":
        return (dict(layout=layout_pattern(rng, "strided", H, nq, nk)), dict(causal=True, sliding_window=5))
    if case == "layout_or_rule":
        return (dict(layout=layout_pattern(rng, "global_local", 1, nq, nk)[0]),
                dict(random_rule(rng, T, S), causal=True))
    if case == "rule_and_rule":
        return dict(causal=True), dict(random_rule(rng, T, S), sliding_window=(3, 1))
    if case == "rule_or_rule":
        mask = rng.random((B, 1, T, S)) < 0.1
        return dict(random_rule(rng, T, S), causal=True), dict(attention_mask=mask)
    if case in ("layout_or_layout", "layout_and_layout"):  # different grains
        fine = layout_pattern(rng, "random", H, nq, nk)
        coarse = layout_pattern(rng, "global_local", 1, -(-T // (2 * bq)), -(-S // (4 * bk)))[0]
        return dict(layout=fine), dict(layout=coarse, layout_block=(2 * bq, 4 * bk))
    if case == "rule_with_layout_or_layout":  # (R and L1) or L2: only through a dense mask
        return (dict(causal=True, layout=layout_pattern(rng, "random", 1, nq, nk)[0]),
                dict(layout=layout_pattern(rng, "strided", H, nq, nk)))
    if case == "rule_or_layout_or_layout":  # (R or L1) or L2: one rule, one layout
        return (dict(sliding_window=(4, 0), combine="or",
                     layout=layout_pattern(rng, "random", 1, nq, nk)[0]),
                dict(layout=layout_pattern(rng, "strided", H, -(-T // (2 * bq)), nk),
                     layout_block=(2 * bq, bk)))
    if case == "everything_or_layout":  # no rule, no layout: every pair visible
        return dict(), dict(layout=layout_pattern(rng, "random", 1, nq, nk)[0])
    raise AssertionError(case)


# A rule joined to a layout by one operator, then to another layout by the other: exact only
# through a dense token mask, which the package does not build behind the caller's back.
MIXED = {("rule_with_layout_or_layout", "or"), ("rule_or_layout_or_layout", "and")}
COMBINATIONS = ["layout_and_rule", "layout_or_rule", "rule_and_rule", "rule_or_rule", "layout_or_layout",
                "layout_and_layout", "rule_with_layout_or_layout", "rule_or_layout_or_layout",
                "everything_or_layout"]


@pytest.mark.parametrize("op", ["and", "or"])
@pytest.mark.parametrize("case", COMBINATIONS)
def test_intersection_and_union(case, op, rng):
    """Exact token masks, and no dense mask built on the way: two rules become one rule of two
    clauses (or one merged clause), whose tile kinds are the combination of the two masks' kinds."""
    T, S, bq, bk = (50, 23, 16, 4) if "rule" in case else (37, 37, 8, 16)
    kw_a, kw_b = combination_operands(rng, case, T, S, bq, bk)
    with jax.disable_jit():
        a = make_block_mask(T, S, q_block=bq, kv_block=bk, **kw_a)
        b = make_block_mask(T, S, q_block=bq, kv_block=bk, **kw_b)
        if (case, op) in MIXED:  # (R & L1) | L2 or (R | L1) & L2: no rule and layout say it
            with pytest.raises(ValueError, match="attention_mask=a.token_mask"):
                intersection(a, b) if op == "and" else union(a, b)
            return
        combined = intersection(a, b) if op == "and" else union(a, b)
        operator = (a & b) if op == "and" else (a | b)
        va, vb = brute_visible(T, S, blocks=(bq, bk), **kw_a), brute_visible(T, S, blocks=(bq, bk), **kw_b)
        expected = (va & vb) if op == "and" else (va | vb)
        kinds = None
        if combined.rule is not None and combined.rule.other is not None:
            ka, kb = brute_kinds(va, bq, bk), brute_kinds(vb, bq, bk)
            kinds = np.minimum(ka, kb) if op == "and" else np.maximum(ka, kb)
        if case == "rule_and_rule":  # causal on positions arange and on the given ones: two clauses
            assert combined.rule.other is not None and combined.rule.op == op
        if case == "rule_or_rule":  # the token mask goes to the first clause (or merges, for and)
            assert combined.rule.attention_mask is not None
            assert (combined.rule.other is not None) == (op == "or")
        check_mask(combined, expected, kinds)
        for x, y in zip(mask_arrays(combined), mask_arrays(operator)):
            np.testing.assert_array_equal(x, y)


def test_combining_masks_of_different_lengths_is_an_error():
    with jax.disable_jit():
        a = make_block_mask(16, 16, q_block=8, kv_block=8)
        b = make_block_mask(16, 24, q_block=8, kv_block=8)
    with pytest.raises(ValueError, match="lengths"):
        intersection(a, b)
    with pytest.raises(ValueError):
        union(a, "causal")


# ----------------------------------------------------------------------------------------------
# jit: built inside a jitted function from traced ids; a BlockMask as a jit argument (pytree).
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("T", "S", "bq", "bk"))
def jitted_rule_mask(q_ids, kv_ids, q_pos, kv_pos, *, T, S, bq, bk):
    return make_block_mask(T, S, q_block=bq, kv_block=bk, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                           q_positions=q_pos, kv_positions=kv_pos, causal=True, sliding_window=(6, 2))


def test_builder_under_jit(rng):
    T, S, bq, bk = 50, 23, 16, 4
    sorted_keys = random_rule(rng, T, S)  # keys in (segment, position) order: the arithmetic path
    any_order = dict(sorted_keys, kv_positions=rng.integers(-10, 60, (B, S)).astype(np.int32),
                     q_positions=rng.integers(-10, 60, (B, T)).astype(np.int32))
    for kw in (sorted_keys, any_order):  # one compiled function, both branches of its cond
        mask = jitted_rule_mask(kw["q_segment_ids"], kw["kv_segment_ids"], kw["q_positions"],
                                kw["kv_positions"], T=T, S=S, bq=bq, bk=bk)
        check_mask(mask, brute_visible(T, S, causal=True, sliding_window=(6, 2), **kw))


def test_attention_mask_and_layout_under_jit(rng):
    T, S, bq, bk = 37, 37, 8, 16
    attention_mask = rng.random((B, 1, T, S)) < 0.3
    layout = layout_pattern(rng, "random", H, -(-T // 16), -(-S // 16))

    @jax.jit
    def build(attention_mask, layout):
        by_mask = make_block_mask(T, S, q_block=bq, kv_block=bk, attention_mask=attention_mask)
        by_layout = make_block_mask(T, S, q_block=bq, kv_block=bk, layout=layout, layout_block=16,
                                    causal=True, combine="or")
        return by_mask, by_layout

    by_mask, by_layout = build(attention_mask, layout)
    check_mask(by_mask, brute_visible(T, S, attention_mask=attention_mask))
    check_mask(by_layout, brute_visible(T, S, layout=layout, layout_block=(16, 16), causal=True,
                                        combine="or"))


def test_block_mask_passes_through_jit(rng):
    T, S, bq, bk = 37, 37, 8, 16
    kw = dict(random_rule(rng, T, S), causal=True, sliding_window=4)
    with jax.disable_jit():
        mask = make_block_mask(T, S, q_block=bq, kv_block=bk, **kw)
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (rebuilt.q_block, rebuilt.kv_block, rebuilt.rule.window) == (bq, bk, (4, 4))

    @jax.jit
    def use(m):
        return m, m.visited_fraction(), m.token_mask(), m.with_blocks(32, 4)

    same, fraction, tokens, other = use(mask)
    vis = brute_visible(T, S, **kw)
    check_mask(same, vis)
    check_mask(other, vis)
    np.testing.assert_array_equal(np.broadcast_to(tokens, (B, 1, T, S)), vis)
    kinds = brute_kinds(vis, bq, bk)
    np.testing.assert_allclose(np.asarray(fraction), (kinds != EMPTY).mean(axis=(-2, -1)), rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument.
# ----------------------------------------------------------------------------------------------

IDS_T = np.zeros((B, 16), np.int32)
IDS_S = np.zeros((B, 24), np.int32)

BAD_INPUTS = [
    ("q_segment_ids", dict(q_segment_ids=np.zeros((B, 15), np.int32), kv_segment_ids=IDS_S)),
    ("kv_segment_ids", dict(q_segment_ids=IDS_T, kv_segment_ids=np.zeros((B, 16), np.int32))),
    ("q_positions", dict(q_positions=np.zeros((B, 17), np.int32), causal=True)),
    ("kv_positions", dict(kv_positions=np.zeros((B, 16), np.int32), causal=True)),
    ("q_block", dict(q_block=12)),
    ("kv_block", dict(kv_block=0)),
    ("q_block", dict(q_block=16.0)),
    ("sliding_window", dict(sliding_window=-1)),
    ("sliding_window", dict(sliding_window=(3, -2))),
    ("sliding_window", dict(sliding_window=(1, 2, 3))),
    ("q_segment_ids", dict(q_segment_ids=np.zeros(16, np.int32), kv_segment_ids=IDS_S)),
    ("kv_segment_ids", dict(q_segment_ids=IDS_T, kv_segment_ids=np.zeros((1, B, 24), np.int32))),
    ("q_positions", dict(q_positions=np.zeros((B, 16), np.float32), causal=True)),
    ("kv_segment_ids", dict(q_segment_ids=IDS_T, kv_segment_ids=np.zeros((B, 24), np.float32))),
    ("kv_segment_ids", dict(q_segment_ids=IDS_T)),
    ("q_segment_ids", dict(kv_segment_ids=IDS_S)),
    ("layout", dict(layout=np.ones((3, 3), bool))),
    ("layout", dict(layout=np.ones((2, 2, 3, 3), bool))),
    ("layout_block", dict(layout=np.ones((1, 1), bool), layout_block=24)),
    ("layout", dict(q_block=16, layout=np.ones((2, 3), bool), layout_block=8)),  # finer than a block
    ("layout_block", dict(layout_block=16)),  # without a layout
    ("combine", dict(layout=np.ones((2, 3), bool), combine="xor")),
    ("attention_mask", dict(attention_mask=np.ones((B, 1, 16, 23), bool))),
    ("attention_mask", dict(attention_mask=np.ones((16, 24), bool))),
    ("attention_mask", dict(attention_mask=np.ones((1, 1, 16, 24), np.float32))),
    ("batch", dict(q_segment_ids=IDS_T, kv_segment_ids=np.zeros((3, 24), np.int32))),
    ("q_len", dict(q_len=-1)),
    ("q_positions", dict(q_positions=np.full((B, 16), 2**30, np.int64), causal=True)),
    ("kv_positions", dict(kv_positions=np.full((B, 24), -2**31, np.int64), sliding_window=3)),
    ("q_segment_ids", dict(q_segment_ids=np.zeros((B, 16), bool), kv_segment_ids=IDS_S)),
]


@pytest.mark.parametrize("name, kwargs", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(name, kwargs):
    kwargs = dict(dict(q_len=16, kv_len=24, q_block=8, kv_block=8), **kwargs)
    q_len, kv_len = kwargs.pop("q_len"), kwargs.pop("kv_len")
    with pytest.raises(ValueError, match=name):
        make_block_mask(q_len, kv_len, **kwargs)


def test_rules_combine_into_at_most_two_clauses(rng):
    """A rule that implies the other is kept as it is; compatible rules merge into one clause; two
    clauses is the most the kernels evaluate: a third is a ValueError naming the dense way."""
    T, S, bq, bk = 37, 37, 8, 16
    kw = random_rule(rng, T, S)
    with jax.disable_jit():
        docs = make_block_mask(T, S, q_block=bq, kv_block=bk, causal=True, **kw)
        same = make_block_mask(T, S, q_block=bq, kv_block=bk, causal=True, **kw)
        window = make_block_mask(T, S, q_block=bq, kv_block=bk, sliding_window=(2, 2),
                                 q_positions=kw["q_positions"], kv_positions=kw["kv_positions"])
        causal = make_block_mask(T, S, q_block=bq, kv_block=bk, causal=True)
        shifted = make_block_mask(T, S, q_block=bq, kv_block=bk, sliding_window=(5, 0),
                                  q_positions=kw["q_positions"] + 1, kv_positions=kw["kv_positions"])
        assert (docs & same).rule.other is None and (docs | same).rule.other is None
        merged = (docs & window).rule  # the same positions (equal values): one clause
        assert merged.other is None and merged.causal and merged.window == (2, 2)
        check_mask(docs & window, brute_visible(T, S, causal=True, sliding_window=(2, 2), **kw))
        two = docs & causal  # causal on two sets of positions: two clauses
        assert two.rule.other is not None
        assert ((two & docs).rule.other is not None) and (two & docs).rule.own.q_segment_ids is not None
        with pytest.raises(ValueError, match="attention_mask=a.token_mask"):
            two & shifted
        with pytest.raises(ValueError, match="attention_mask=a.token_mask"):
            (docs | causal) & shifted
