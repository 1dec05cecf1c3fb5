"""Block masks: which tiles of the attention matrix a kernel visits, and which need a token mask.

An attention kernel works on tiles: a block of ``q_block`` queries against a block of ``kv_block``
keys. For a given mask every tile is one of three kinds:

* **empty** (0): no query of the block sees any key of the block. The kernel skips the tile.
* **partial** (1): some pairs are visible, some are not. The kernel computes the tile and then
  evaluates the *token rule* (segment ids, positions, causal, window, token mask) pair by pair.
* **full** (2): every pair is visible. The kernel computes the tile and needs no per-token test.

:class:`BlockMask` stores the kinds and, so that a kernel can walk them without scanning a whole
row, the same information as padded lists (FlexAttention's ``BlockMask`` does the same): for every
(batch row, head, query block) the number of partial key blocks and their indices, and the number of
full key blocks and their indices. The *transposed* lists (for every key block, the query blocks
that visit it) are what a dK/dV backward walks. All arrays have fixed shapes, so a mask is built and
used under ``jax.jit``; it is a pytree, so it passes through ``jit`` and ``custom_vjp``.

**What a mask means, token by token.** A mask is a *token rule* ``R`` (any of: equal segment ids;
``q_pos >= kv_pos`` for ``causal``; ``q_pos - left <= kv_pos <= q_pos + right`` for a sliding
window; a token-level ``attention_mask``), optionally combined with a *block layout* ``L`` (a
boolean per ``layout_block`` tile) by ``and`` or ``or``. The kernel evaluates ``R`` in partial tiles
only. That is exact because a layout never makes a tile partial: kernel tiles are never larger than
layout tiles, so a listed layout tile covers whole kernel tiles, which are then full where the
layout decides (``or``) or decided by ``R`` (``and``). The block sizes of a mask are a property of
the *kernel*; the same mask at other block sizes (a backward's) is :meth:`BlockMask.with_blocks`,
one call, and :meth:`BlockMask.keeping` builds those lists once and stores them in the mask.

**Exact.** A tile is listed iff at least one pair in it is visible and full iff all are (pairs past
the ends of the sequences do not count). With a token ``attention_mask`` this is computed from the
dense mask; without one, from per-block summaries (for *full*) and a binary search per query token
over each key block's keys sorted by (segment, position) (for *any*), which is exact for positions
in any order.

**Two rules, no dense mask.** Masks combine with ``&`` and ``|`` (and a prebuilt mask with the rules
of an attention call) without ever forming the ``T x S`` token mask: two rules that can be one (the
same positions, the same segment ids or one side without) merge into one; otherwise the rule gets a
second *clause* (:class:`TokenRule` ``other``), which partial tiles evaluate too, and the tile kinds
are the two masks' kinds combined tile by tile (``and``: empty if either is, full if both are;
``or``: full if either is, empty if both are; partial otherwise). The token mask stays exact; such a
partial tile may hold no visible pair (or only visible ones): work, not a wrong answer. What would
need a third clause, or a rule joined to one layout by ``and`` and to another by ``or``, is a
``ValueError`` naming the dense alternative (an explicit ``attention_mask``).

Positions are ``int32`` and must lie in ``(-2**30, 2**30)`` (checked when concrete); windows are
clipped to ``2**30``. Segment ids of any integer dtype are compared exactly: ids that do not fit in
int32 are renumbered by their rank (order and equality kept).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from ejk_lite.checks import power_of_two
from ejk_lite.launch import vary_like

EMPTY, PARTIAL, FULL = 0, 1, 2
_BIG = 2**30  # windows are clipped here so that position +- window never overflows int32
_I32_MIN, _I32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


# ----------------------------------------------------------------------------------------------
# The token rule: what a partial tile evaluates pair by pair.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenRule:
    """Visibility of one (query token, key token) pair; every rule given must hold.

    Arrays have a leading batch axis of 1 (shared by every row) or B. ``attention_mask`` is
    ``[B or 1, H or 1, T, S]`` bool.

    A rule may have a second *clause*, ``other`` (a rule of segments, positions, causal and
    window, without a token mask or a clause of its own), joined to this one by ``op``
    (``"and"`` / ``"or"``): that is how two rules combine without a dense mask; partial tiles
    evaluate both clauses.
    """

    q_segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    q_positions: Array | None = None
    kv_positions: Array | None = None
    attention_mask: Array | None = None
    causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    window: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    other: TokenRule | None = None
    op: str = dataclasses.field(default="and", metadata=dict(static=True))

    @property
    def uses_positions(self) -> bool:
        """Whether this rule's own clause reads positions (causal or a window)."""
        return self.causal or self.window is not None

    @property
    def loads_positions(self) -> bool:
        """Whether this rule's own clause reads positions that were given: without them a
        token's position is its index, which a kernel computes instead of loading."""
        return self.uses_positions and not (self.q_positions is None
                                            and self.kv_positions is None)

    @property
    def own(self) -> TokenRule:
        """This rule's own clause, without ``other``."""
        return self if self.other is None else dataclasses.replace(self, other=None, op="and")

    @property
    def batch(self) -> int:
        arrays = (self.q_segment_ids, self.kv_segment_ids, self.q_positions, self.kv_positions)
        sizes = [a.shape[0] for a in arrays if a is not None]
        if self.attention_mask is not None:
            sizes.append(self.attention_mask.shape[0])
        if self.other is not None:
            sizes.append(self.other.batch)
        return max(sizes, default=1)

    @property
    def heads(self) -> int:
        return 1 if self.attention_mask is None else self.attention_mask.shape[1]

    def positions(self, q_len: int, kv_len: int) -> tuple[Array, Array]:
        """Query and key positions, ``[batch or 1, len]`` int32 (``arange`` where not given)."""
        qp, kp = self.q_positions, self.kv_positions
        qp = jnp.arange(q_len, dtype=jnp.int32)[None] if qp is None else qp
        kp = jnp.arange(kv_len, dtype=jnp.int32)[None] if kp is None else kp
        return qp, kp

    def segments(self, q_len: int, kv_len: int) -> tuple[Array, Array]:
        """Query and key segment ids, ``[batch or 1, len]`` int32 (one segment where not given)."""
        qs, ks = self.q_segment_ids, self.kv_segment_ids
        qs = jnp.zeros((1, q_len), jnp.int32) if qs is None else qs
        ks = jnp.zeros((1, kv_len), jnp.int32) if ks is None else ks
        return qs, ks

    def key_interval(self, q_pos: Array) -> tuple[Array, Array]:
        """The closed interval of key positions a query at ``q_pos`` may see: ``[lo, hi]``."""
        lo = jnp.full_like(q_pos, _I32_MIN)
        hi = jnp.full_like(q_pos, _I32_MAX)
        if self.window is not None:
            left, right = self.window
            lo = q_pos - min(left, _BIG)
            hi = q_pos + min(right, _BIG)
        if self.causal:
            hi = jnp.minimum(hi, q_pos)
        return lo, hi

    def dense(self, q_len: int, kv_len: int) -> Array:
        """The rule as a dense boolean ``[batch, heads, T, S]`` (tests, pictures, small sizes)."""
        if self.other is not None:
            a, b = self.own.dense(q_len, kv_len), self.other.dense(q_len, kv_len)
            return a & b if self.op == "and" else a | b
        qs, ks = self.segments(q_len, kv_len)
        qp, kp = self.positions(q_len, kv_len)
        lo, hi = self.key_interval(qp)
        kpos = kp[:, None, :]
        visible = ((qs[:, :, None] == ks[:, None, :]) & (lo[:, :, None] <= kpos)
                   & (kpos <= hi[:, :, None]))
        visible = visible[:, None]
        if self.attention_mask is not None:
            visible = visible & self.attention_mask
        return visible


jax.tree_util.register_dataclass(
    TokenRule,
    data_fields=["q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "attention_mask",
                 "other"],
    meta_fields=["causal", "window", "op"],
)


# ----------------------------------------------------------------------------------------------
# The block mask.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Which key blocks each query block visits (and the transposed view), at one pair of sizes.

    Arrays (``Bm`` is 1 or the batch, ``Hm`` 1 or the number of query heads; size 1 broadcasts):

    * ``kinds`` ``[Bm, Hm, nQ, nK]`` int8: ``EMPTY`` / ``PARTIAL`` / ``FULL`` per tile;
    * ``partial_count`` ``[Bm, Hm, nQ]`` and ``partial_index`` ``[Bm, Hm, nQ, nK]`` int32: the
      partial key blocks of each query block, ascending, first ``partial_count`` entries valid;
      ``full_count`` / ``full_index`` likewise for full key blocks;
    * ``t_partial_count`` ``[Bm, Hm, nK]`` / ``t_partial_index`` ``[Bm, Hm, nK, nQ]`` and
      ``t_full_*``: the same, transposed (the query blocks that visit each key block).

    ``rule`` is the token rule partial tiles evaluate (``None``: every pair of a listed tile is
    visible); ``layout`` an optional boolean ``[1 or H, nLQ, nLK]`` at ``layout_block`` tokens per
    tile,
    combined with the rule by ``combine`` (``"and"`` / ``"or"``).
    """

    kinds: Array
    partial_count: Array
    partial_index: Array
    full_count: Array
    full_index: Array
    t_partial_count: Array
    t_partial_index: Array
    t_full_count: Array
    t_full_index: Array
    rule: TokenRule | None
    layout: Array | None
    q_len: int = dataclasses.field(metadata=dict(static=True))
    kv_len: int = dataclasses.field(metadata=dict(static=True))
    q_block: int = dataclasses.field(metadata=dict(static=True))
    kv_block: int = dataclasses.field(metadata=dict(static=True))
    layout_block: tuple[int, int] | None = dataclasses.field(default=None,
                                                             metadata=dict(static=True))
    combine: str = dataclasses.field(default="and", metadata=dict(static=True))
    # The same mask at other block sizes, built once (:meth:`keeping`), without rule and layout.
    kept: tuple[BlockMask, ...] = ()

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(Bm, Hm, nQ, nK)``."""
        return tuple(self.kinds.shape)

    def with_blocks(self, q_block: int, kv_block: int) -> BlockMask:
        """The same mask (same token semantics) at other block sizes, e.g. the backward's: the
        lists :meth:`keeping` stored, or built from the rule and layout."""
        if (q_block, kv_block) == (self.q_block, self.kv_block):
            return self
        for kept in self.kept:
            if (kept.q_block, kept.kv_block) == (q_block, kv_block):
                return dataclasses.replace(kept, rule=self.rule, layout=self.layout)
        return build_block_mask(self.rule, self.layout, self.layout_block, self.combine,
                      self.q_len, self.kv_len, q_block, kv_block)

    def keeping(self, *blocks: tuple[int, int]) -> BlockMask:
        """The same mask, holding its lists at each ``(q_block, kv_block)`` of ``blocks`` as well,
        built now: :meth:`with_blocks` then returns them with no build. For a mask built once
        and used by many calls whose backward tiles differ from the forward's, e.g.
        ``mask.keeping((bwd.block_q, bwd.block_kv))``; FlexAttention's ``BlockMask`` likewise
        holds what its backward walks. Each kept size costs its lists' memory."""
        kept = list(self.kept)
        for size in blocks:
            if not isinstance(size, tuple) or len(size) != 2:
                raise ValueError(f"keeping takes (q_block, kv_block) pairs, got {size!r}")
            power_of_two(size[0], "q_block")
            power_of_two(size[1], "kv_block")
            size = (int(size[0]), int(size[1]))
            if size != (self.q_block, self.kv_block) and all(
                    (m.q_block, m.kv_block) != size for m in kept):
                kept.append(dataclasses.replace(self.with_blocks(*size), rule=None, layout=None))
        return dataclasses.replace(self, kept=tuple(kept))

    def token_mask(self) -> Array:
        """The mask as a dense boolean ``[Bm, Hm, T, S]``: memory T x S, for tests and pictures."""
        return dense_mask(self.rule, self.layout, self.layout_block, self.combine, self.q_len,
                          self.kv_len)

    def visited_fraction(self) -> Array:
        """Fraction of tiles visited (partial or full), per ``[Bm, Hm]``: the work against dense."""
        return jnp.mean((self.kinds != EMPTY).astype(jnp.float32), axis=(-2, -1))

    def __and__(self, other: BlockMask) -> BlockMask:
        return intersection(self, other)

    def __or__(self, other: BlockMask) -> BlockMask:
        return union(self, other)


jax.tree_util.register_dataclass(
    BlockMask,
    data_fields=["kinds", "partial_count", "partial_index", "full_count", "full_index",
                 "t_partial_count", "t_partial_index", "t_full_count", "t_full_index", "rule",
                 "layout", "kept"],
    meta_fields=["q_len", "kv_len", "q_block", "kv_block", "layout_block", "combine"],
)


def dense_mask(rule: TokenRule | None, layout: Array | None, layout_block: tuple[int, int] | None,
               combine: str, T: int, S: int) -> Array:
    """A rule and a layout as one dense boolean ``[Bm, Hm, T, S]`` (the definition kernels meet)."""
    visible = None if rule is None else rule.dense(T, S)
    if layout is not None:
        lq, lk = layout_block
        tokens = jnp.repeat(jnp.repeat(layout, lq, axis=-2)[..., :T, :], lk, axis=-1)[..., :S][None]
        if visible is None:
            visible = tokens
        else:
            visible = visible & tokens if combine == "and" else visible | tokens
    if visible is None:
        visible = jnp.ones((1, 1, T, S), bool)
    return visible


# ----------------------------------------------------------------------------------------------
# Tile kinds, step by step: from a token rule, from a dense token mask, from a layout.
# ----------------------------------------------------------------------------------------------


def _blocks(x: Array, length: int, block: int, fill: Any) -> Array:
    """``[..., length]`` -> ``[..., n_blocks, block]``, the tail padded with ``fill``."""
    n = -(-length // block)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, n * block - length)]
    return jnp.pad(x, pad, constant_values=fill).reshape(*x.shape[:-1], n, block)


def _count_before(sorted_seg, sorted_pos, n_valid, seg, pos, inclusive: bool) -> Array:
    """How many of a block's sorted keys come before ``(seg, pos)`` (lexicographically; ``<=`` if
    ``inclusive``). ``sorted_*`` are ``[Bm, nK, bk]``, ``n_valid`` ``[Bm, 1, nK]``, ``seg``/``pos``
    ``[Bm, T, 1]``; the result is ``[Bm, T, nK]``. A binary search, ``log2(bk) + 1`` steps."""
    Bm, nK, bk = sorted_seg.shape
    lo = jnp.zeros((Bm, seg.shape[1], nK), jnp.int32)
    hi = jnp.broadcast_to(n_valid, lo.shape)
    keys_seg, keys_pos = sorted_seg[:, None], sorted_pos[:, None]  # [Bm, 1, nK, bk]

    def step(_, bounds):  # a loop, not unrolled: XLA compiles one body (and folds no constants)
        lo, hi = bounds
        mid = (lo + hi) // 2
        at = jnp.minimum(mid, bk - 1)[..., None]
        s = jnp.take_along_axis(keys_seg, at, axis=-1)[..., 0]
        p = jnp.take_along_axis(keys_pos, at, axis=-1)[..., 0]
        before = (s < seg) | ((s == seg) & ((p <= pos) if inclusive else (p < pos)))
        active = lo < hi
        return jnp.where(active & before, mid + 1, lo), jnp.where(active & ~before, mid, hi)

    bounds = tuple(vary_like((lo, hi), sorted_seg, sorted_pos, n_valid, seg, pos))
    return jax.lax.fori_loop(0, bk.bit_length(), step, bounds)[0]


def _rule_kinds(rule: TokenRule, T: int, S: int, bq: int, bk: int) -> Array:
    """Tile kinds ``[Bm, Hm, nQ, nK]`` of a token rule, exact for any segments and positions. With
    two clauses, the kinds of each combined tile by tile (exact where it can be without looking at
    pairs: ``and`` is empty if either is, full if both are; ``or`` full if either is, empty if both
    are; partial otherwise, where the kernel's pair-by-pair test decides)."""
    if rule.other is not None:
        a, b = _rule_kinds(rule.own, T, S, bq, bk), _rule_kinds(rule.other, T, S, bq, bk)
        return jnp.minimum(a, b) if rule.op == "and" else jnp.maximum(a, b)
    if rule.attention_mask is not None:
        return _dense_kinds(rule.dense(T, S), T, S, bq, bk)
    qs, ks = rule.segments(T, S)
    qp, kp = rule.positions(T, S)
    B = max(qs.shape[0], ks.shape[0], qp.shape[0], kp.shape[0])
    qs, qp = jnp.broadcast_to(qs, (B, T)), jnp.broadcast_to(qp, (B, T))
    ks, kp = jnp.broadcast_to(ks, (B, S)), jnp.broadcast_to(kp, (B, S))
    lo, hi = rule.key_interval(qp)

    # Keys in (segment, position) order along the sequence -- packed documents with increasing
    # positions, the usual case -- make each query's visible keys one contiguous index range: then
    # counting visible pairs per tile is arithmetic. Any other order takes the general path.
    key_order = (ks[:, 1:] > ks[:, :-1]) | ((ks[:, 1:] == ks[:, :-1]) & (kp[:, 1:] >= kp[:, :-1]))
    operands = (qs, lo, hi, ks, kp)
    kinds = jax.lax.cond(jnp.all(key_order), functools.partial(_kinds_sorted_keys, T, S, bq, bk),
                         functools.partial(_kinds_any_order, T, S, bq, bk), *operands)
    return kinds[:, None]


def _rank(keys_seg, keys_pos, seg, pos, inclusive: bool) -> Array:
    """How many of the sorted keys ``[B, S]`` come before ``(seg, pos)`` ``[B, T]`` (``<=`` if
    ``inclusive``): a binary search, one batched gather per step."""
    S = keys_seg.shape[1]
    lo = jnp.zeros(seg.shape, jnp.int32)
    hi = jnp.full(seg.shape, S, jnp.int32)

    def step(_, bounds):  # a loop, not unrolled: XLA compiles one body (and folds no constants)
        lo, hi = bounds
        mid = (lo + hi) // 2
        at = jnp.minimum(mid, S - 1)
        s = jnp.take_along_axis(keys_seg, at, axis=1)
        p = jnp.take_along_axis(keys_pos, at, axis=1)
        before = (s < seg) | ((s == seg) & ((p <= pos) if inclusive else (p < pos)))
        active = lo < hi
        return jnp.where(active & before, mid + 1, lo), jnp.where(active & ~before, mid, hi)

    bounds = tuple(vary_like((lo, hi), keys_seg, keys_pos, seg, pos))
    return jax.lax.fori_loop(0, max(S, 1).bit_length(), step, bounds)[0]


def _kinds_sorted_keys(T, S, bq, bk, qs, lo, hi, ks, kp) -> Array:
    """Keys sorted along S: query i sees exactly the keys ``first_i <= k < end_i``, so a tile's
    visible pairs are ``sum_i |[first_i, end_i) & [kv block]|``; listed iff > 0, full iff all."""
    first = _rank(ks, kp, qs, lo, inclusive=False)
    end = _rank(ks, kp, qs, hi, inclusive=True)
    first = _blocks(first, T, bq, 0)[..., None]  # [B, nQ, bq, 1]; padding rows see nothing
    end = _blocks(end, T, bq, 0)[..., None]
    starts = jnp.arange(0, S, bk, dtype=jnp.int32)  # [nK]
    stops = jnp.minimum(starts + bk, S)
    overlap = jnp.maximum(jnp.minimum(end, stops) - jnp.maximum(first, starts), 0)
    pairs = jnp.sum(overlap, axis=2)  # [B, nQ, nK] visible pairs per tile
    q_valid = jnp.minimum(T - jnp.arange(0, T, bq), bq)
    all_pairs = q_valid[:, None] * (stops - starts)[None, :]
    kinds = jnp.where(pairs == all_pairs, FULL, jnp.where(pairs > 0, PARTIAL, EMPTY))
    return kinds.astype(jnp.int8)


def _kinds_any_order(T, S, bq, bk, qs, lo, hi, ks, kp) -> Array:
    """Any key order: summaries per block decide *full*; a binary search per query token over each
    key block's keys, sorted by (segment, position), decides *any*."""
    # Full: every (valid) query of the block sees every (valid) key of the block. With one segment
    # on both sides, that is: the largest lower bound <= the smallest key position, and the largest
    # key position <= the smallest upper bound.
    def summary(x, length, block, reduce, fill):
        return reduce(_blocks(x, length, block, fill), axis=-1)

    q_seg_lo = summary(qs, T, bq, jnp.min, _I32_MAX)
    q_seg_hi = summary(qs, T, bq, jnp.max, _I32_MIN)
    k_seg_lo = summary(ks, S, bk, jnp.min, _I32_MAX)
    k_seg_hi = summary(ks, S, bk, jnp.max, _I32_MIN)
    lo_max, hi_min = summary(lo, T, bq, jnp.max, _I32_MIN), summary(hi, T, bq, jnp.min, _I32_MAX)
    k_pos_lo = summary(kp, S, bk, jnp.min, _I32_MAX)
    k_pos_hi = summary(kp, S, bk, jnp.max, _I32_MIN)
    one_segment = ((q_seg_lo == q_seg_hi)[:, :, None] & (k_seg_lo == k_seg_hi)[:, None, :]
                   & (q_seg_lo[:, :, None] == k_seg_lo[:, None, :]))
    full = (one_segment & (lo_max[:, :, None] <= k_pos_lo[:, None, :])
            & (k_pos_hi[:, None, :] <= hi_min[:, :, None]))

    # Any: for each query token, count the keys of each key block inside [(seg, lo), (seg, hi)],
    # with the keys sorted by (segment, position) and the padding past S sorted last.
    valid_k = _blocks(jnp.ones((1, S), bool), S, bk, False)  # [1, nK, bk]
    seg_b = jnp.where(valid_k, _blocks(ks, S, bk, 0), _I32_MAX)
    pos_b = jnp.where(valid_k, _blocks(kp, S, bk, 0), _I32_MAX)
    order = jnp.lexsort((pos_b, seg_b), axis=-1)
    seg_sorted = jnp.take_along_axis(seg_b, order, axis=-1)
    pos_sorted = jnp.take_along_axis(pos_b, order, axis=-1)
    n_valid = jnp.sum(valid_k, axis=-1, dtype=jnp.int32)[:, None, :]  # [1, 1, nK]
    first = _count_before(seg_sorted, pos_sorted, n_valid, qs[:, :, None], lo[:, :, None],
                          inclusive=False)
    last = _count_before(seg_sorted, pos_sorted, n_valid, qs[:, :, None], hi[:, :, None],
                         inclusive=True)
    sees = (last > first).swapaxes(1, 2)  # [B, nK, T]: query token sees something in the key block
    any_visible = jnp.any(_blocks(sees, T, bq, False), axis=-1).swapaxes(1, 2)  # [B, nQ, nK]
    return jnp.where(full, FULL, jnp.where(any_visible, PARTIAL, EMPTY)).astype(jnp.int8)


def _dense_kinds(visible: Array, T: int, S: int, bq: int, bk: int) -> Array:
    """Tile kinds of a dense boolean ``[Bm, Hm, T, S]``: padding counts as invisible for *any* and
    visible for *all*, so only real pairs decide."""
    def tiles(fill):
        x = _blocks(visible, S, bk, fill)  # [..., T, nK, bk]
        x = _blocks(x.swapaxes(-3, -1), T, bq, fill)  # [..., bk, nK, nQ, bq]
        return x

    any_visible = jnp.any(tiles(False), axis=(-4, -1)).swapaxes(-1, -2)
    all_visible = jnp.all(tiles(True), axis=(-4, -1)).swapaxes(-1, -2)
    return jnp.where(all_visible, FULL, jnp.where(any_visible, PARTIAL, EMPTY)).astype(jnp.int8)


def _layout_kinds(layout: Array, layout_block: tuple[int, int], T: int, S: int, bq: int,
                  bk: int) -> Array:
    """A layout refined to kernel tiles (never coarser than the layout): FULL where listed."""
    lq, lk = layout_block
    rows = (jnp.arange(-(-T // bq)) * bq) // lq
    cols = (jnp.arange(-(-S // bk)) * bk) // lk
    listed = layout[:, rows][:, :, cols]
    return jnp.where(listed, FULL, EMPTY).astype(jnp.int8)[None]


def _lists(kinds: Array, kind: int) -> tuple[Array, Array]:
    """Count and ascending indices of the ``kind`` tiles along the last axis (padded lists)."""
    selected = kinds == kind
    count = jnp.sum(selected, axis=-1, dtype=jnp.int32)
    index = jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)
    # Under shard_map argsort's result is typed as the same on every shard whatever the input
    # (JAX 0.11): a residual typed so would be kept from one shard only. Type it as its input.
    return count, vary_like([index], kinds)[0]


def build_block_mask(rule, layout, layout_block, combine, T, S, bq, bk) -> BlockMask:
    """The block mask of a checked rule and/or layout at ``(bq, bk)``: what :func:`make_block_mask`
    and attention (which builds its masks at its own tile sizes) share."""
    power_of_two(bq, "q_block")
    power_of_two(bk, "kv_block")
    if layout is not None and (bq > layout_block[0] or bk > layout_block[1]):
        raise ValueError(f"block sizes ({bq}, {bk}) must not exceed the layout's tiles "
                         f"{layout_block}: "
                         "a kernel tile must lie inside one layout tile for the mask to stay exact")
    nQ, nK = -(-T // bq), -(-S // bk)
    kinds = None if rule is None else _rule_kinds(rule, T, S, bq, bk)
    if layout is not None:
        lk = _layout_kinds(layout, layout_block, T, S, bq, bk)
        if kinds is None:
            kinds = lk
        else:
            kinds = jnp.minimum(kinds, lk) if combine == "and" else jnp.maximum(kinds, lk)
    if kinds is None:
        kinds = jnp.full((1, 1, nQ, nK), FULL, jnp.int8)
    return _from_kinds(kinds, rule, layout, layout_block, combine, T, S, bq, bk)


def _from_kinds(kinds, rule, layout, layout_block, combine, T, S, bq, bk) -> BlockMask:
    rows_t = kinds.swapaxes(-1, -2)
    pc, pi = _lists(kinds, PARTIAL)
    fc, fi = _lists(kinds, FULL)
    tpc, tpi = _lists(rows_t, PARTIAL)
    tfc, tfi = _lists(rows_t, FULL)
    return BlockMask(kinds, pc, pi, fc, fi, tpc, tpi, tfc, tfi, rule, layout,
                     q_len=T, kv_len=S, q_block=bq, kv_block=bk,
                     layout_block=None if layout is None else tuple(layout_block), combine=combine)


def restrict(mask: BlockMask, extra: TokenRule, rule: TokenRule | None = None) -> BlockMask:
    """``mask`` and ``extra`` must both hold: the mask's own kinds (as built, no rebuild at its
    block sizes) combined with those of ``extra`` tile by tile, and partial tiles evaluate
    ``rule``, the two rules combined (:func:`combine_rules`, unless given). No dense mask. A
    ``mask`` that joins its rule and a layout by ``or`` cannot be restricted so (its tiles would
    need two different rules): a ``ValueError``."""
    if mask.rule is not None and mask.layout is not None and mask.combine == "or":
        raise ValueError("a mask that joins its rule and its layout by 'or' cannot take one more "
                         "rule without a dense token mask")
    if rule is None:
        rule = extra if mask.rule is None else combine_rules(mask.rule, extra, "and")
    if rule is mask.rule:
        return mask
    T, S, bq, bk = mask.q_len, mask.kv_len, mask.q_block, mask.kv_block
    kinds = jnp.minimum(mask.kinds, _rule_kinds(extra, T, S, bq, bk))
    return _from_kinds(kinds, rule, mask.layout, mask.layout_block, "and", T, S, bq, bk)


# ----------------------------------------------------------------------------------------------
# Checks, then the public builders.
# ----------------------------------------------------------------------------------------------


def _check_ids(name: str, x: Any, length: int, batch: int | None) -> Any:
    """Shape and dtype of ids ``[batch or 1, length]``; returned as given (NumPy or JAX)."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an integer array [batch, {length}], "
                         f"got {type(x).__name__}")
    if len(x.shape) != 2 or x.shape[1] != length:
        raise ValueError(f"{name} must have shape [batch, {length}], got {tuple(x.shape)}")
    if batch is not None and x.shape[0] not in (1, batch):
        raise ValueError(f"{name} has batch {x.shape[0]}, expected 1 or {batch}")
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")
    return x


def _fits_int32(dtype: Any) -> bool:
    return jnp.iinfo(dtype).min >= _I32_MIN and jnp.iinfo(dtype).max <= _I32_MAX


def _positions_int32(name: str, x: Any) -> Array | None:
    """Positions as int32. Concrete values outside ``(-2**30, 2**30)`` are an error: the kernels
    compute ``kv_pos - q_pos`` and ``pos +- window`` in int32, which would overflow. Traced values
    cannot be checked here; the documented range is the caller's to keep."""
    if x is None:
        return None
    if _is_concrete(x) and np.asarray(x).size:
        values = np.asarray(x)
        low, high = values.min(), values.max()
        if low <= -_BIG or high >= _BIG:
            raise ValueError(f"{name} must lie in (-2**30, 2**30), got values in [{low}, {high}]")
        return jnp.asarray(values.astype(np.int32))
    return jnp.asarray(x).astype(jnp.int32)


def _segments_int32(q_ids: Any, kv_ids: Any) -> tuple[Array, Array]:
    """Segment ids as int32, equal exactly where the given ids are equal (only equality matters,
    and their order, which the mask builder uses to find sorted keys). Ids whose dtype fits in
    int32 are cast; wider ones (int64, uint32, ...) that do not fit are replaced by their rank
    among all the ids of the call, which keeps both, for any values: no two ids merge."""
    if _fits_int32(q_ids.dtype) and _fits_int32(kv_ids.dtype):
        return jnp.asarray(q_ids).astype(jnp.int32), jnp.asarray(kv_ids).astype(jnp.int32)
    if _is_concrete(q_ids) and _is_concrete(kv_ids):
        q, kv = np.asarray(q_ids), np.asarray(kv_ids)
        both = np.concatenate([q.ravel(), kv.ravel()])
        if both.size == 0 or (both.min() >= _I32_MIN and both.max() <= _I32_MAX):
            return jnp.asarray(q.astype(np.int32)), jnp.asarray(kv.astype(np.int32))
        ranks = np.unique(both, return_inverse=True)[1].astype(np.int32)
        return (jnp.asarray(ranks[:q.size].reshape(q.shape)),
                jnp.asarray(ranks[q.size:].reshape(kv.shape)))
    # Traced (a 64-bit dtype exists only with jax_enable_x64): the rank, computed in the graph.
    dtype = jnp.promote_types(q_ids.dtype, kv_ids.dtype)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"q_segment_ids ({q_ids.dtype}) and kv_segment_ids ({kv_ids.dtype}) "
                         "have no common integer dtype: give them one dtype")
    both = jnp.concatenate([jnp.ravel(q_ids).astype(dtype), jnp.ravel(kv_ids).astype(dtype)])
    order = jnp.argsort(both)
    ordered = both[order]
    new_value = jnp.concatenate([jnp.zeros(1, jnp.int32),
                                 (ordered[1:] != ordered[:-1]).astype(jnp.int32)])
    ranks = jnp.zeros(both.shape, jnp.int32).at[order].set(jnp.cumsum(new_value))
    n_q = int(np.prod(q_ids.shape))
    return ranks[:n_q].reshape(q_ids.shape), ranks[n_q:].reshape(kv_ids.shape)


def normalize_window(sliding_window: Any) -> tuple[int, int] | None:
    """``None``, an int ``W`` (-> ``(W, W)``) or ``(left, right)``, each a non-negative int."""
    if sliding_window is None:
        return None
    window = sliding_window
    if isinstance(sliding_window, (int, np.integer)):
        window = (sliding_window, sliding_window)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                       for w in window)):
        raise ValueError(f"sliding_window must be an int or a (left, right) pair of ints, "
                         f"got {sliding_window!r}")
    if window[0] < 0 or window[1] < 0:
        raise ValueError(f"sliding_window sizes must be >= 0, got {tuple(window)}")
    return int(window[0]), int(window[1])


def token_rule(q_len: int, kv_len: int, *, q_segment_ids=None, kv_segment_ids=None,
               q_positions=None, kv_positions=None, causal: bool = False, sliding_window=None,
               attention_mask=None,
               batch: int | None = None, heads: int | None = None) -> TokenRule | None:
    """Check the rule arguments and bundle them (``None`` when no rule is given)."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        missing = "kv_segment_ids" if kv_segment_ids is None else "q_segment_ids"
        raise ValueError(f"{missing} is missing: give q_segment_ids and kv_segment_ids together")
    q_segment_ids = _check_ids("q_segment_ids", q_segment_ids, q_len, batch)
    kv_segment_ids = _check_ids("kv_segment_ids", kv_segment_ids, kv_len, batch)
    q_positions = _check_ids("q_positions", q_positions, q_len, batch)
    kv_positions = _check_ids("kv_positions", kv_positions, kv_len, batch)
    window = normalize_window(sliding_window)
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if q_segment_ids is not None:
        q_segment_ids, kv_segment_ids = _segments_int32(q_segment_ids, kv_segment_ids)
    if causal or window is not None:  # positions matter only to causal and window rules
        q_positions = _positions_int32("q_positions", q_positions)
        kv_positions = _positions_int32("kv_positions", kv_positions)
    else:
        q_positions = kv_positions = None
    if attention_mask is not None:
        shape = getattr(attention_mask, "shape", None)
        if shape is None or len(shape) != 4 or tuple(shape[2:]) != (q_len, kv_len):
            raise ValueError(f"attention_mask must have shape [batch or 1, heads or 1, {q_len}, "
                             f"{kv_len}], "
                             f"got {shape}")
        if batch is not None and shape[0] not in (1, batch):
            raise ValueError(f"attention_mask has batch {shape[0]}, expected 1 or {batch}")
        if heads is not None and shape[1] not in (1, heads):
            raise ValueError(f"attention_mask has {shape[1]} heads, expected 1 or {heads}")
        dtype = jnp.asarray(attention_mask).dtype
        if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
            raise ValueError(f"attention_mask must be bool or 0/1 integers, got {dtype}")
        attention_mask = jnp.asarray(attention_mask) != 0
    ids = (q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    batches = {a.shape[0] for a in ids if a is not None} - {1}
    if attention_mask is not None and attention_mask.shape[0] != 1:
        batches.add(attention_mask.shape[0])
    if len(batches) > 1:
        raise ValueError(f"segment ids, positions and attention_mask disagree on the batch size: "
                         f"{sorted(batches)}")
    if all(a is None for a in ids) and attention_mask is None and not causal and window is None:
        return None
    return TokenRule(q_segment_ids, kv_segment_ids, q_positions, kv_positions, attention_mask,
                     causal=bool(causal), window=window)


def check_layout(layout: Any, T: int, S: int, layout_block: tuple[int, int],
                 heads: int | None) -> Array:
    shape = getattr(layout, "shape", None)
    lq, lk = layout_block
    expected = (-(-T // lq), -(-S // lk))
    if shape is None or len(shape) not in (2, 3) or tuple(shape[-2:]) != expected:
        raise ValueError(f"layout must be a boolean [n_q_blocks, n_kv_blocks] or [heads, "
                         f"n_q_blocks, n_kv_blocks] with blocks {layout_block}, i.e. "
                         f"[..., {expected[0]}, {expected[1]}]; "
                         f"got shape {shape}")
    if len(shape) == 3 and heads is not None and shape[0] not in (1, heads):
        raise ValueError(f"layout has {shape[0]} heads, expected 1 or {heads}")
    layout = jnp.asarray(layout)
    if not (layout.dtype == jnp.bool_ or jnp.issubdtype(layout.dtype, jnp.integer)):
        raise ValueError(f"layout must be bool or 0/1 integers, got {layout.dtype}")
    layout = layout != 0
    return layout if layout.ndim == 3 else layout[None]


def make_block_mask(
    q_len: int,
    kv_len: int,
    *,
    q_block: int = 128,
    kv_block: int = 128,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    attention_mask: Array | None = None,
    layout: Array | None = None,
    layout_block: int | tuple[int, int] | None = None,
    combine: str = "and",
) -> BlockMask:
    """Build the block mask of a token rule and/or a block layout, at ``(q_block, kv_block)``.

    Rules (every one given must hold for a pair to be visible): equal ``q_segment_ids`` /
    ``kv_segment_ids`` ``[B, T]`` / ``[B, S]`` (packed documents); ``causal``: ``q_pos >= kv_pos``;
    ``sliding_window`` ``W`` or ``(left, right)``: ``q_pos - left <= kv_pos <= q_pos + right``;
    positions ``[B, T]`` / ``[B, S]``, ``arange`` where not given; ``attention_mask``
    ``[B or 1, H or 1, T, S]`` (bool or 0/1), honoured exactly. ``layout``: a boolean per tile of
    ``layout_block`` tokens (default: the block sizes), ``[nLQ, nLK]`` or ``[H, nLQ, nLK]``,
    combined with the rules by ``combine`` (``"and"``: both must allow a pair; ``"or"``: either). No
    rule and no layout: every pair is visible. Positions are read by ``causal`` and the window
    only: given without them they are no rule, and a layout stands alone whatever ``combine``.
    """
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    power_of_two(q_block, "q_block")
    power_of_two(kv_block, "kv_block")
    if combine not in ("and", "or"):
        raise ValueError(f"combine must be 'and' or 'or', got {combine!r}")
    rule = token_rule(q_len, kv_len, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      q_positions=q_positions, kv_positions=kv_positions, causal=causal,
                      sliding_window=sliding_window, attention_mask=attention_mask)
    if layout is not None:
        if layout_block is None:
            layout_block = (q_block, kv_block)
        if isinstance(layout_block, (int, np.integer)):
            layout_block = (layout_block, layout_block)
        power_of_two(layout_block[0], "layout_block")
        power_of_two(layout_block[1], "layout_block")
        layout = check_layout(layout, q_len, kv_len, tuple(layout_block), None)
    elif layout_block is not None:
        raise ValueError("layout_block is given but layout is not")
    return build_block_mask(rule, layout, layout_block, combine, int(q_len), int(kv_len), int(q_block),
                  int(kv_block))


# ----------------------------------------------------------------------------------------------
# Combining rules and masks, without a dense token mask.
# ----------------------------------------------------------------------------------------------

_ARRAY_FIELDS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "attention_mask")


def _same(x: Any, y: Any) -> bool:
    """The same array: one object (traced ones can only be compared so), or concrete with the same
    shape and values. ``None`` is the same as ``None`` (the default ids)."""
    if x is None or y is None or x is y:
        return x is y
    if not (_is_concrete(x) and _is_concrete(y)) or x.shape != y.shape or x.dtype != y.dtype:
        return False
    return bool(np.array_equal(np.asarray(x), np.asarray(y)))


def _merge_and(a: TokenRule, b: TokenRule) -> TokenRule | None:
    """One clause allowing exactly the pairs both one-clause rules allow, or ``None`` when that
    takes two (causal or windows on different positions, different segment ids)."""
    if a.other is not None or b.other is not None:
        return None
    if b.q_segment_ids is None:
        segments = (a.q_segment_ids, a.kv_segment_ids)
    elif a.q_segment_ids is None:
        segments = (b.q_segment_ids, b.kv_segment_ids)
    elif _same(a.q_segment_ids, b.q_segment_ids) and _same(a.kv_segment_ids, b.kv_segment_ids):
        segments = (a.q_segment_ids, a.kv_segment_ids)
    else:
        return None
    if not b.uses_positions:
        positions = (a.q_positions, a.kv_positions)
    elif not a.uses_positions:
        positions = (b.q_positions, b.kv_positions)
    elif _same(a.q_positions, b.q_positions) and _same(a.kv_positions, b.kv_positions):
        positions = (a.q_positions, a.kv_positions)
    else:
        return None
    token_mask = a.attention_mask if b.attention_mask is None else b.attention_mask
    if a.attention_mask is not None and b.attention_mask is not None:  # two dense masks, given
        token_mask = a.attention_mask if _same(a.attention_mask, b.attention_mask) \
            else a.attention_mask & b.attention_mask
    windows = [w for w in (a.window, b.window) if w is not None]
    window = (min(w[0] for w in windows), min(w[1] for w in windows)) if windows else None
    return TokenRule(*segments, *positions, token_mask, causal=a.causal or b.causal, window=window)


def _implies(a: TokenRule, b: TokenRule) -> bool:
    """Every pair ``a`` allows, the one-clause ``b`` allows too, as far as the fields tell (the same
    arrays, ``b``'s window no tighter): then ``a and b`` is ``a``."""
    if a.other is not None:
        own, other = _implies(a.own, b), _implies(a.other, b)
        return (own or other) if a.op == "and" else (own and other)
    if b.attention_mask is not None and not _same(a.attention_mask, b.attention_mask):
        return False  # (and no [T, S] work to find it out)
    merged = _merge_and(a, b)
    return (merged is not None and merged.causal == a.causal and merged.window == a.window
            and all(getattr(merged, f) is getattr(a, f) for f in _ARRAY_FIELDS))


def _two_clauses(a: TokenRule, b: TokenRule, op: str) -> TokenRule:
    """``a op b`` for one-clause rules, as a rule with a second clause. The kernels read a token
    mask in the first clause only: it goes there (joined to the other's first, for ``and``)."""
    if b.attention_mask is not None and a.attention_mask is None:
        a, b = b, a
    if b.attention_mask is not None:
        if op == "or":  # both sides hold a dense mask already: one dense mask is no loss
            return TokenRule(attention_mask=a.dense(*a.attention_mask.shape[2:])
                             | b.dense(*b.attention_mask.shape[2:]))
        a = dataclasses.replace(a, attention_mask=a.attention_mask & b.attention_mask)
        b = dataclasses.replace(b, attention_mask=None)
    return dataclasses.replace(a, other=b, op=op)


def combine_rules(a: TokenRule, b: TokenRule, op: str) -> TokenRule:
    """``a op b`` (``op`` ``"and"`` / ``"or"``) as one :class:`TokenRule` of at most two clauses,
    which is what the kernels evaluate: a rule that implies the other is kept as it is, two
    compatible clauses joined by ``and`` merge into one. Three clauses: a ``ValueError``."""
    if _implies(a, b) if b.other is None else False:
        return a if op == "and" else b
    if _implies(b, a) if a.other is None else False:
        return b if op == "and" else a
    if a.other is None and b.other is None:
        merged = _merge_and(a, b) if op == "and" else None
        return merged if merged is not None else _two_clauses(a, b, op)
    pair, single = (a, b) if a.other is not None else (b, a)
    if single.other is None and op == "and" and pair.op == "and":
        for first, second in ((pair.own, pair.other), (pair.other, pair.own)):
            merged = _merge_and(first, single)
            if merged is not None:
                return _two_clauses(merged, second, "and")
    symbol = "&" if op == "and" else "|"
    raise ValueError(f"combining these rules by '{op}' takes more than two clauses, which the "
                     "kernels do not evaluate: build one mask from a dense token mask, e.g. "
                     f"make_block_mask(..., attention_mask=a.token_mask() {symbol} b.token_mask())")


def _merge_layouts(a: BlockMask, b: BlockMask, op: str) -> tuple[Array, tuple[int, int]]:
    """Two masks' layouts joined by ``op``, at the finer of the two grains."""
    if a.layout is None or b.layout is None:
        one = a if b.layout is None else b
        return one.layout, one.layout_block
    grain = (min(a.layout_block[0], b.layout_block[0]), min(a.layout_block[1], b.layout_block[1]))
    la = _layout_kinds(a.layout, a.layout_block, a.q_len, a.kv_len, *grain)[0] == FULL
    lb = _layout_kinds(b.layout, b.layout_block, a.q_len, a.kv_len, *grain)[0] == FULL
    return (la & lb if op == "and" else la | lb), grain


def _combine(a: BlockMask, b: BlockMask, op: str) -> BlockMask:
    if not isinstance(a, BlockMask) or not isinstance(b, BlockMask):
        raise ValueError("masks combine with other BlockMasks only")
    if (a.q_len, a.kv_len) != (b.q_len, b.kv_len):
        raise ValueError(f"masks cover different lengths: {(a.q_len, a.kv_len)} and "
                         f"{(b.q_len, b.kv_len)}")
    bq, bk = min(a.q_block, b.q_block), min(a.kv_block, b.kv_block)
    T, S = a.q_len, a.kv_len

    def build(rule, layout, grain, combine):
        if grain is not None:
            return build_block_mask(rule, layout, grain, combine, T, S, min(bq, grain[0]), min(bk, grain[1]))
        return build_block_mask(rule, layout, None, combine, T, S, bq, bk)

    if b.rule is None and b.layout is None:  # b allows every pair: and keeps a, or gives b
        a, b = b, a
    if a.rule is None and a.layout is None:
        kept = b if op == "and" else a
        return build(kept.rule, kept.layout, kept.layout_block, kept.combine)
    if a.rule is None:
        a, b = b, a
    # Each side is (rule combine layout). Joined by op, it stays one rule and one layout when
    # every side that has both joins them by op too (op is associative and commutative).
    mixed = [m for m in (a, b) if m.rule is not None and m.layout is not None and m.combine != op]
    if mixed:
        raise ValueError(f"a mask that joins its rule and its layout by '{mixed[0].combine}' "
                         f"cannot be joined to another by '{op}' without a dense token mask: build "
                         f"one mask from it, e.g. make_block_mask(..., "
                         f"attention_mask=a.token_mask() {'&' if op == 'and' else '|'} "
                         f"b.token_mask())")
    rule = a.rule if b.rule is None else combine_rules(a.rule, b.rule, op)
    if a.layout is None and b.layout is None:
        return build(rule, None, None, "and")
    layout, grain = _merge_layouts(a, b, op)
    return build(rule, layout, grain, op)


def intersection(a: BlockMask, b: BlockMask) -> BlockMask:
    """Pairs visible in both masks: the rules combined (at most two clauses in all) and the layouts
    combined, no dense mask. A ``ValueError`` where that cannot be exact (see :func:`union`)."""
    return _combine(a, b, "and")


def union(a: BlockMask, b: BlockMask) -> BlockMask:
    """Pairs visible in either mask: the rules combined (at most two clauses in all) and the layouts
    combined, no dense mask. A mask that joins a rule and a layout by ``and`` cannot be joined to
    another by ``or`` exactly (nor one joined by ``or`` by ``and``): a ``ValueError`` says what to
    pass."""
    return _combine(a, b, "or")


# ----------------------------------------------------------------------------------------------
# A mask that comes from outside: its arrays decide which memory the kernels read.
# ----------------------------------------------------------------------------------------------

# (prefix, kind listed, transposed): the four padded lists of a BlockMask
_LISTS = (("partial", PARTIAL, False), ("full", FULL, False),
          ("t_partial", PARTIAL, True), ("t_full", FULL, True))


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_block_mask(mask: Any, name: str, batch: int, heads: int, q_len: int, kv_len: int) -> None:
    """Check a caller's :class:`BlockMask` against the call: shapes and dtypes always (they are
    static), values when the arrays are concrete. The kernels read key and query blocks at the
    listed indices, so a list that points outside its range would read outside the inputs.

    Under ``jit`` the values cannot be checked; the kernels clamp every index and count they
    load, so a wrong traced mask gives wrong numbers, never a read outside the arrays.
    """
    if not isinstance(mask, BlockMask):
        raise ValueError(f"{name} must be a BlockMask, got {type(mask).__name__}")
    if (mask.q_len, mask.kv_len) != (q_len, kv_len):
        raise ValueError(f"{name} covers lengths {(mask.q_len, mask.kv_len)}, the inputs "
                         f"{(q_len, kv_len)}")
    power_of_two(mask.q_block, f"{name}.q_block")
    power_of_two(mask.kv_block, f"{name}.kv_block")
    shape = tuple(getattr(mask.kinds, "shape", ()))
    if len(shape) != 4:
        hint = (": its arrays have a leading axis from jax.vmap; use it inside the same vmap, or "
                "index one element" if len(shape) == 5 else "")
        raise ValueError(f"{name}.kinds must have 4 axes [batch or 1, heads or 1, n_q_blocks, "
                         f"n_kv_blocks], got shape {shape}{hint}")
    Bm, Hm = shape[:2]
    if Bm not in (1, batch) or Hm not in (1, heads):
        raise ValueError(f"{name} has batch {Bm} and heads {Hm}; expected 1 or {batch}, "
                         f"1 or {heads}")
    nQ, nK = -(-q_len // mask.q_block), -(-kv_len // mask.kv_block)
    expected = {"kinds": ((Bm, Hm, nQ, nK), jnp.int8)}
    for prefix, _, transposed in _LISTS:
        rows, cols = (nK, nQ) if transposed else (nQ, nK)
        expected[f"{prefix}_count"] = ((Bm, Hm, rows), jnp.int32)
        expected[f"{prefix}_index"] = ((Bm, Hm, rows, cols), jnp.int32)
    for field, (want, dtype) in expected.items():
        x = getattr(mask, field)
        got = (tuple(getattr(x, "shape", ())), getattr(x, "dtype", None))
        if got != (want, dtype):
            raise ValueError(f"{name}.{field} must be {jnp.dtype(dtype).name} of shape "
                             f"{list(want)} (blocks {mask.q_block} x {mask.kv_block}), "
                             f"got {got[1]} of shape "
                             f"{list(got[0])}")
    if mask.rule is not None:
        _check_rule_shapes(mask.rule, f"{name}.rule", batch, heads, q_len, kv_len)
    if all(_is_concrete(getattr(mask, field)) for field in expected):
        _check_mask_values(mask, name)
    if not isinstance(mask.kept, tuple):
        raise ValueError(f"{name}.kept must be a tuple of BlockMasks (BlockMask.keeping), got "
                         f"{type(mask.kept).__name__}")
    for i, kept in enumerate(mask.kept):  # the backward's kernels read these lists too
        check_block_mask(kept, f"{name}.kept[{i}]", batch, heads, q_len, kv_len)
        if kept.kept or kept.rule is not None or kept.layout is not None:
            raise ValueError(f"{name}.kept[{i}] must hold lists only (no rule, layout or kept "
                             "masks of its own): build it with BlockMask.keeping")


def _check_rule_shapes(rule: TokenRule, name: str, batch: int, heads: int, T: int, S: int) -> None:
    for field, length in (("q_segment_ids", T), ("kv_segment_ids", S), ("q_positions", T),
                          ("kv_positions", S)):
        x = getattr(rule, field)
        if x is not None and (len(x.shape) != 2 or x.shape[0] not in (1, batch)
                              or x.shape[1] != length):
            raise ValueError(f"{name}.{field} must have shape [1 or {batch}, {length}], "
                             f"got {list(x.shape)}")
    am = rule.attention_mask
    if am is not None and (len(am.shape) != 4 or am.shape[0] not in (1, batch)
                           or am.shape[1] not in (1, heads) or tuple(am.shape[2:]) != (T, S)):
        raise ValueError(f"{name}.attention_mask must have shape [1 or {batch}, 1 or {heads}, "
                         f"{T}, {S}], got {list(am.shape)}")
    if rule.other is not None:
        _check_rule_shapes(rule.other, f"{name}.other", batch, heads, T, S)


def _check_mask_values(mask: BlockMask, name: str) -> None:
    """Kinds in {EMPTY, PARTIAL, FULL}; each list's count in ``[0, n]``, its first ``count`` entries
    in ``[0, n)``, ascending, and exactly the tiles of its kind. Vectorised NumPy, O(tiles)."""
    kinds = np.asarray(mask.kinds)
    if not np.isin(kinds, (EMPTY, PARTIAL, FULL)).all():
        raise ValueError(f"{name}.kinds must hold only {EMPTY}, {PARTIAL}, {FULL} "
                         "(empty, partial, full)")
    for prefix, kind, transposed in _LISTS:
        k = kinds.swapaxes(-1, -2) if transposed else kinds
        n = k.shape[-1]
        count = np.asarray(getattr(mask, f"{prefix}_count"))
        index = np.asarray(getattr(mask, f"{prefix}_index"))
        if count.size == 0:
            continue
        if count.min() < 0 or count.max() > n:
            raise ValueError(f"{name}.{prefix}_count must lie in [0, {n}], got values in "
                             f"[{count.min()}, {count.max()}]")
        valid = np.arange(n) < count[..., None]
        outside = valid & ((index < 0) | (index >= n))
        if outside.any():
            raise ValueError(f"{name}.{prefix}_index: its first {prefix}_count entries must lie in "
                             f"[0, {n}), got {index[outside][0]}")
        if not np.array_equal(count, np.sum(k == kind, axis=-1)):
            raise ValueError(f"{name}.{prefix}_count disagrees with {name}.kinds")
        listed = np.take_along_axis(k, np.where(valid, index, 0), axis=-1) == kind
        ascending = np.diff(index, axis=-1) > 0
        if not (listed | ~valid).all() or not (ascending | ~valid[..., 1:]).all():
            raise ValueError(f"{name}.{prefix}_index must list the tiles {name}.kinds marks "
                             f"{'partial' if kind == PARTIAL else 'full'}, ascending")
