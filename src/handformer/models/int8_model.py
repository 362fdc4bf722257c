"""The int8 model's other parts: its token embedding, and how a model becomes int8.

* :class:`Int8Embedding`: int8 rows, dequantized as they are gathered (a model quantized in
  memory, or loaded from safetensors); :class:`FileEmbedding`: rows read from the checkpoint
  file on lookup (a GGUF file: nothing of the table resident);
* :class:`Int8Installer`: what ``load_lm(..., quantize="int8")`` hands each weight as it reads
  it (projections that read one input packed together, a tied head packed from the
  embedding's rows); :func:`quantize_model`: the same for a model already in memory.

The products themselves are :mod:`handformer.models.quantized`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor, nn

from handformer.layers import projection_groups
from handformer.models.int4 import Int4Linear, int4_eligible
from handformer.models.int8_weights import (
    QuantizedRows,
    gather_rows,
    quantize_tensor,
    quantize_weight,
    release_free_memory,
)
from handformer.models.quantized import Int8Linear

__all__ = ["Int8Embedding", "FileEmbedding", "Int8Installer", "int4_names", "quantize_model"]


class Int8Embedding(nn.Module):
    """A token embedding whose rows are int8, one scale per row (outlier columns exactly);
    a lookup dequantizes only the rows it gathers.

    Args:
        weight: the quantized table ``(num_embeddings, embedding_dim)``
            (:class:`~handformer.models.int8_weights.QuantizedRows`).

    Attributes:
        num_embeddings, embedding_dim: as ``nn.Embedding``'s.
    """

    def __init__(self, weight: QuantizedRows) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self._table = weight

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding | Tensor) -> Int8Embedding:
        """The int8 version of an embedding (or of a ``(V, E)`` float weight)."""
        weight = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
        return cls(quantize_tensor(weight))

    @property
    def weight(self) -> Tensor:
        """The dequantized table ``(num_embeddings, embedding_dim)``, float32: a new tensor
        each time."""
        return self._table.dequantize()

    def head(self) -> Int8Linear:
        """An LM head tied to this embedding: an :class:`Int8Linear` of the same int8 rows."""
        return Int8Linear.from_int8(self._table)

    def forward(self, ids: Tensor) -> Tensor:
        """``(...)`` token ids -> ``(..., embedding_dim)`` float32."""
        return self._table.dequantize(ids)

    def __deepcopy__(self, memo: dict) -> Int8Embedding:
        """A copy sharing the int8 rows (nothing writes them)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        nn.Module.__init__(new)
        new.num_embeddings, new.embedding_dim, new.training = (
            self.num_embeddings, self.embedding_dim, self.training)
        new._table = self._table
        return new

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row weights"


class FileEmbedding(nn.Module):
    """A token embedding whose rows stay in the checkpoint file: a lookup reads and
    dequantizes the rows it gathers (what ``load_lm(file.gguf, quantize="int8")`` installs;
    the file's own values, so the embedding is exactly the float model's).

    Args:
        rows: the row source: ``rows(ids)`` returns ``(*ids.shape, E)`` float32,
            ``rows.table()`` the whole ``(V, E)`` table, ``rows.shape`` is ``(V, E)``
            (:class:`~handformer.pretrained.gguf.dequant.GGUFRows`).

    Attributes:
        num_embeddings, embedding_dim: as ``nn.Embedding``'s.
    """

    def __init__(self, rows: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = rows.shape  # type: ignore[attr-defined]
        self._rows = rows

    @property
    def weight(self) -> Tensor:
        """The whole table ``(num_embeddings, embedding_dim)``, float32, read from the file:
        a new tensor each time."""
        return self._rows.table()  # type: ignore[attr-defined]

    def forward(self, ids: Tensor) -> Tensor:
        """``(...)`` token ids -> ``(..., embedding_dim)`` float32."""
        return self._rows(ids)

    def __deepcopy__(self, memo: dict) -> FileEmbedding:
        """A copy reading the same file."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        nn.Module.__init__(new)
        new.num_embeddings, new.embedding_dim, new.training = (
            self.num_embeddings, self.embedding_dim, self.training)
        new._rows = self._rows
        return new

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the file"


# ---- installing ---------------------------------------------------------------------------


class Int8Installer:
    """What a loader calls with each float weight of a model built on ``meta``: a linear
    layer's weight becomes an :class:`Int8Linear` in its place at once, the token embedding
    an :class:`Int8Embedding` or a :class:`FileEmbedding` (the float tensor can then be
    freed); everything else is the loader's to install.

    Args:
        model: the model, its parameters still on ``meta``.
        quantize: ``"int8"``, or ``"int4"``: the projections the 4-bit kernel takes become
            :class:`~handformer.models.int4.Int4Linear` layers (:func:`int4_names`), the
            rest as with ``"int8"``.
        wider: with ``"int4"``, projections whose checkpoint holds more than 4 bits a weight
            (a GGUF file's Q5_0, Q6_K, Q8_0, float tensors): they stay int8, as does the rest
            of their group.
    """

    def __init__(self, model: nn.Module, quantize: str = "int8", *,
                 wider: set[str] | frozenset[str] = frozenset()) -> None:
        self.model = model
        self._int4 = int4_names(model, wider) if quantize == "int4" else set()
        head, embedding = getattr(model, "lm_head", None), getattr(model, "tok_emb", None)
        self._tied = (type(head) is nn.Linear and type(embedding) is nn.Embedding
                      and head.weight is embedding.weight)
        # the projections that read one input: each one's group (names in order), and the
        # quantized weights of a group waiting for the rest of it
        self._group_of = {name: names for names in _group_names(model) for name in names}
        self._waiting: dict[str, QuantizedRows] = {}

    def wants(self, name: str) -> bool:
        """Whether ``name`` is a weight this installer quantizes."""
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight":
            return False
        module = self.model.get_submodule(owner)
        return type(module) is nn.Linear or (type(module) is nn.Embedding
                                             and owner == "tok_emb")

    def wants_file_rows(self, name: str) -> bool:
        """Whether ``name`` is the token embedding (it may stay in the file)."""
        return name == "tok_emb.weight" and self.wants(name)

    def take(self, name: str, value: Tensor) -> bool:
        """Install ``value`` if :meth:`wants` ``name`` (True), else False."""
        if not self.wants(name):
            return False
        return self.take_rows(name, tuple(value.shape), lambda: [(slice(None), value)])

    def take_rows(self, name: str, shape: tuple[int, ...], read: Callable[[], Iterable],
                  file_rows: Callable[[Tensor], Tensor] | None = None) -> bool:
        """Install the weight ``name`` of ``shape`` from its rows, read in chunks:
        ``read()`` returns ``(rows, values)`` pairs, ``rows`` a slice or index tensor of the
        rows that ``values`` fill (each row once); it may be called twice
        (:func:`~handformer.models.int8_weights.quantize_weight`). Only the int8 rows are
        kept, and for the token embedding with ``file_rows`` (its rows read from the file,
        see :class:`FileEmbedding`) not even those: a tied head is packed from them, then
        they go. False if not :meth:`wants` it.

        Raises:
            ValueError: for a weight with inf or NaN entries.
        """
        if not self.wants(name):
            return False
        owner = name.rpartition(".")[0]
        module = self.model.get_submodule(owner)
        weight = (gather_rows(read, tuple(shape)) if owner in self._int4  # float, for int4
                  else quantize_weight(read, tuple(shape)))
        if type(module) is nn.Embedding:
            if self._tied:
                _replace(self.model, "lm_head", Int8Linear.from_int8(weight))
            _replace(self.model, owner, FileEmbedding(file_rows) if file_rows is not None
                     else Int8Embedding(weight))
        elif owner in self._group_of:
            self._waiting[owner] = weight
            self._install_group(self._group_of[owner])
        elif owner in self._int4:
            _replace(self.model, owner, Int4Linear(weight, module.bias))
        else:
            _replace(self.model, owner, Int8Linear.from_int8(weight, module.bias))
        del weight
        release_free_memory()
        return True

    def _install_group(self, names: tuple[str, ...], partial: bool = False) -> None:
        present = [n for n in names if n in self._waiting]
        if not present or (len(present) < len(names) and not partial):
            return
        biases = [self.model.get_submodule(n).bias for n in present]  # loaded later
        kind = Int4Linear if present[0] in self._int4 else Int8Linear  # a group is one kind
        layers = kind.group([self._waiting.pop(n) for n in present], biases)
        for name, layer in zip(present, layers, strict=True):
            _replace(self.model, name, layer)

    def finish(self) -> None:
        """Install what is waiting: the projections of a group the checkpoint did not give
        whole (each then packed with the rest of its group that was read)."""
        for names in {tuple(g) for g in self._group_of.values()}:
            self._install_group(names, partial=True)

    def tie(self, head: str = "lm_head") -> None:
        """A head tied to the embedding: the embedding's int8 rows, packed for the product
        (nothing to do where :meth:`take_rows` packed it already)."""
        if type(self.model.get_submodule(head)) is Int8Linear:
            return
        embedding = self.model.get_submodule("tok_emb")
        _replace(self.model, head, embedding.head() if isinstance(embedding, Int8Embedding)
                 else Int8Linear(embedding.weight))


def int4_names(model: nn.Module, wider: set[str] | frozenset[str] = frozenset()
               ) -> set[str]:
    """The ``nn.Linear`` projections of ``model`` that ``quantize="int4"`` makes 4-bit: every
    one but the LM head whose weight the kernel takes and that is not in ``wider`` (a group
    of projections that read one input: all of them or none, by their packed shape); see
    :mod:`handformer.models.int4`."""
    grouped = {n: names for names in _group_names(model) for n in names}
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    picked = set()
    for name, module in linears.items():
        names = grouped.get(name, (name,))
        out = sum(linears[n].out_features for n in names)
        if (name != "lm_head" and not wider.intersection(names)
                and int4_eligible(out, module.in_features)):
            picked.add(name)
    return picked


def _group_names(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each group of ``nn.Linear`` projections that read one input (q/k/v,
    gate/up: :func:`~handformer.layers.projection_groups`) with one input size."""
    names = {id(m): n for n, m in model.named_modules()}
    return [tuple(names[id(m)] for m in group) for group in projection_groups(model)
            if all(type(m) is nn.Linear for m in group)
            and len({m.in_features for m in group}) == 1]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_model(model: nn.Module, quantize: str = "int8") -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for an :class:`Int8Linear` (the
    projections that read one input packed together) and its ``tok_emb`` (an
    ``nn.Embedding``, if it has one) for an :class:`Int8Embedding`, one at a time; a head
    tied to that embedding shares its int8 rows. Everything else stays as it is. For a model
    already in memory (``load_lm(..., quantize="int8")`` quantizes while it reads the
    checkpoint instead).

    Args:
        model: the model (float32, on the CPU).
        quantize: ``"int8"``, or ``"int4"``: the projections of :func:`int4_names` become
            :class:`~handformer.models.int4.Int4Linear` layers instead.

    Returns:
        ``model``.
    """
    int4 = int4_names(model) if quantize == "int4" else set()
    embedding = getattr(model, "tok_emb", None)
    tied = set()
    if type(embedding) is nn.Embedding:
        tied = {n for n, m in model.named_modules()
                if type(m) is nn.Linear and m.weight is embedding.weight}
        _replace(model, "tok_emb", Int8Embedding.from_embedding(embedding))
    for names in _group_names(model):
        modules = [model.get_submodule(n) for n in names]
        if names[0] in int4:
            layers = Int4Linear.group([m.weight for m in modules], [m.bias for m in modules])
        else:
            layers = Int8Linear.group([quantize_tensor(m.weight) for m in modules],
                                      [m.bias for m in modules])
        for name, layer in zip(names, layers, strict=True):
            _replace(model, name, layer)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        module = model.get_submodule(name)
        new = (model.tok_emb.head() if name in tied and module.bias is None
               else Int4Linear.from_linear(module) if name in int4
               else Int8Linear.from_linear(module))
        _replace(model, name, new)
    return model
