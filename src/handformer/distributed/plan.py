"""Who holds what under tensor parallel: whole heads, rows of the MLP, ranges of the vocabulary.

Pure arithmetic on sizes (no tensors, no process group), so every rank works out every
rank's share by itself and the shares agree without a message.

* Query heads: whole heads, as evenly as they go; the first ``H % N`` ranks hold one more
  (SmolLM2's 9 heads on 2 ranks: heads 0-4 and 5-8). A head is never cut.
* Key/value heads: each rank holds the ones its query heads read. When the query heads of
  a rank are whole groups (``H / H_kv`` query heads per key/value head) or lie in one group,
  that is a plain split of the KV heads (or a replica of the one it reads); otherwise a group
  is cut between two ranks and the rank holds one key/value copy per query head (multi-head
  attention locally: SmolLM2's 3 KV heads on 2 ranks).
* MLP hidden units and the vocabulary: contiguous ranges, as evenly as they go.
"""

from __future__ import annotations

__all__ = ["split_evenly", "kv_heads_for", "vocab_range"]


def split_evenly(n: int, parts: int) -> list[range]:
    """``n`` whole units over ``parts`` ranks: contiguous ranges, the first ``n % parts``
    one unit longer. ``split_evenly(9, 2) == [range(0, 5), range(5, 9)]``.

    Args:
        n: how many units (heads, MLP hidden units).
        parts: how many ranks.

    Returns:
        One ``range`` per rank, in rank order.
    """
    base, extra = divmod(n, parts)
    bounds = [0]
    for r in range(parts):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return [range(bounds[r], bounds[r + 1]) for r in range(parts)]


def kv_heads_for(query_heads: range, num_heads: int, num_kv_heads: int) -> list[int]:
    """The key/value heads a rank holds for its ``query_heads``, one entry per local slot.

    Query head ``h`` reads key/value head ``h // (num_heads // num_kv_heads)``. Whole groups
    (or part of one group) keep grouped-query attention locally: each needed head once.
    A group cut between ranks: one slot per query head, so that local query head ``j``
    reads local key/value slot ``j``.

    Args:
        query_heads: the rank's query heads (a range of global indices).
        num_heads: the model's query heads ``H``.
        num_kv_heads: its key/value heads ``H_kv`` (dividing ``H``).

    Returns:
        The global key/value head of each local key/value slot.
    """
    group = num_heads // num_kv_heads
    needed = sorted({h // group for h in query_heads})
    whole = query_heads.start % group == 0 and query_heads.stop % group == 0
    return needed if whole or len(needed) == 1 else [h // group for h in query_heads]


def vocab_range(vocab_size: int, parts: int, rank: int) -> range:
    """This rank's token ids when the vocabulary is sharded: ``torch.chunk``'s rule, which
    DTensor's ``Shard(0)`` follows (pieces of ``ceil(V / N)``, the last ones shorter).

    Args:
        vocab_size: the vocabulary ``V``.
        parts: how many ranks ``N``.
        rank: this rank.

    Returns:
        The token ids this rank's rows of the embedding (and LM head) stand for.
    """
    chunk = -(-vocab_size // parts)
    start = min(vocab_size, rank * chunk)
    return range(start, min(vocab_size, start + chunk))
