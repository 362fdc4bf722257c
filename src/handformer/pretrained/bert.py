"""BERT-family encoders built from handformer's own layers.

    embeddings = LayerNorm(word[ids] + position[0..L-1] + token_type[types])
    hidden     = post-LN EncoderLayer x N   (exact erf GELU, LayerNorm eps from the config)
    pooler     = tanh(dense(hidden[:, 0]))  (when the checkpoint has one)

Shape letters: ``B`` batch, ``L`` length, ``E`` hidden size, ``H`` heads.

Checkpoint keys follow Hugging Face's ``BertModel`` names (with or without a ``bert.``
prefix); :func:`bert_key_map` translates them to this module's names and back.
:meth:`BertModel.from_pretrained` loads a model folder (``config.json`` +
``model.safetensors``), :meth:`BertModel.save_pretrained` writes one.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from handformer.attention.kinds import AttentionKind
from handformer.attention.registry import resolve_attention
from handformer.checks import check_dropout, check_positive_int
from handformer.hooks import HookPoint
from handformer.layers import EncoderLayer, check_attention, clones
from handformer.legacy_names import LegacyNames
from handformer.masks import from_hf_attention_mask
from handformer.pretrained.bert_keys import bert_key_map
from handformer.pretrained.folders import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_device,
    read_config_json,
    resolve_checkpoint_dir,
)
from handformer.pretrained.pooling import SentencePooling
from handformer.weights import (
    load_safetensors,
    read_safetensors_header,
    save_safetensors,
    write_atomically,
)

__all__ = ["BertConfig", "BertModel", "BertOutput", "bert_key_map", "HF_ACTIVATIONS",
           "check_load_options"]

# Hugging Face ``hidden_act`` names -> handformer FeedForward activations.
HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh"}
BERT_FAMILY = ("bert", "roberta", "xlm-roberta", "electra", "camembert")


@dataclass
class BertConfig:
    """Hyper-parameters of a BERT encoder (the fields of Hugging Face's ``config.json``).

    Attributes:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size:
            sizes (``hidden_size % num_attention_heads == 0``).
        hidden_act: ``"gelu"`` (exact erf), ``"gelu_new"``/``"gelu_pytorch_tanh"`` or
            ``"relu"``.
        max_position_embeddings: rows of the position table: the longest input.
        type_vocab_size: number of token types (segments).
        layer_norm_eps: LayerNorm epsilon.
        hidden_dropout_prob, attention_probs_dropout_prob: dropout (training only).
        pad_token_id: id of ``[PAD]``.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            check_positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.hidden_act not in HF_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(HF_ACTIVATIONS)}, "
                             f"got {self.hidden_act!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        check_dropout("hidden_dropout_prob", self.hidden_dropout_prob)
        check_dropout("attention_probs_dropout_prob", self.attention_probs_dropout_prob)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        """Build from a Hugging Face ``config.json`` dict; unknown keys are ignored.

        Raises:
            ValueError: for a model type outside the BERT family, options handformer does not
                implement (relative positions, decoder / cross-attention), or invalid sizes.
        """
        model_type = d.get("model_type", "bert")
        if model_type not in BERT_FAMILY:
            raise ValueError(f"config.json has model_type={model_type!r}; load_bert reads "
                             f"BERT-family encoders ({', '.join(BERT_FAMILY)})")
        if model_type != "bert":
            raise ValueError(f"model_type={model_type!r} uses a different position scheme "
                             "than BERT and is not supported yet; use a 'bert' checkpoint")
        position = d.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"position_embedding_type={position!r} is not supported; "
                             "only 'absolute' positions are implemented")
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise ValueError("config.json describes a decoder (is_decoder / "
                             "add_cross_attention); load_bert loads encoders only")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The config as a ``config.json``-style dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"model_type": "bert"}


@dataclass
class BertOutput:
    """What :class:`BertModel` returns.

    Attributes:
        last_hidden_state: ``(B, L, E)``.
        pooler_output: ``(B, E)`` when the model has a pooler, else None.
        attentions: one ``(B, H, L, L)`` tensor per layer when ``need_weights=True``.
    """

    last_hidden_state: Tensor
    pooler_output: Tensor | None = None
    attentions: tuple[Tensor, ...] | None = None


def _embedding(num: int, dim: int, padding_idx: int | None = None) -> nn.Embedding:
    """An embedding table; built on the meta device (to be loaded) it skips the random init,
    whose meta-device implementation costs seconds on first use."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(num, dim, padding_idx=padding_idx, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim, padding_idx=padding_idx)


class BertEmbeddings(nn.Module):
    """The three embedding tables, their LayerNorm and dropout (Hugging Face's
    ``embeddings.``): :meth:`BertModel.embed` computes ``LayerNorm(word + position +
    token_type)`` followed by dropout, through the model's own hook points.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        E = config.hidden_size
        self.word_embeddings = _embedding(config.vocab_size, E, config.pad_token_id)
        self.position_embeddings = _embedding(config.max_position_embeddings, E)
        self.token_type_embeddings = _embedding(config.type_vocab_size, E)
        self.norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)


class BertPooler(nn.Module):
    """``tanh(dense(hidden[:, 0]))``: the ``[CLS]`` vector through a dense layer."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """``(B, L, E)`` -> ``(B, E)``."""
        return torch.tanh(self.dense(hidden[:, 0]))


AttentionSpec = AttentionKind | str | Callable[[], AttentionKind] | None


class BertModel(LegacyNames, nn.Module):
    """A BERT encoder on handformer's :class:`EncoderLayer` (post-LN, GELU).

    Submodules: ``embeddings`` (the tables), ``blocks`` (the :class:`EncoderLayer` s; each
    path is its hook name, ``blocks.0.attn.hook_pattern``, as TransformerLens'
    ``HookedEncoder``), ``pooler``. Hook points ``hook_embed``, ``hook_pos_embed``,
    ``hook_token_type_embed``: the three embeddings before they are summed, ``(B, L, E)``.

    Args:
        config: the :class:`BertConfig`.
        add_pooling_layer: build the ``[CLS]`` pooler (checkpoints without one load with
            ``False``).
        attention: the attention kind of every layer: an :class:`AttentionKind` (copied into
            each layer), a zero-argument factory, or a name (``"full"``, ``"local"``,
            ``"strided"``, ``"linear"``, with the options below); default full attention.
            Swapping it (e.g. ``"local"`` or ``LocalAttention(window)``) keeps the same
            weights and checkpoint keys.
        window_size, stride, global_tokens: options of a kind given by name (as
            :func:`~handformer.attention.attention_kind`: defaults 5, 3 and 1).
        sentence_pooling: how :func:`handformer.pretrained.embed` turns token vectors into a
            sentence vector (read from a sentence-transformers folder); None = mean pooling.

    Attributes:
        config: the :class:`BertConfig`.
        max_positions: the longest input the position table allows.
        sentence_pooling: the :class:`SentencePooling` or None.

    Raises:
        TypeError: if ``config`` is not a :class:`BertConfig` or ``attention`` is not a kind.
    """

    LEGACY_NAMES = {"encoder.layers": "blocks"}  # state-dict keys (handformer.legacy_names)

    def __init__(self, config: BertConfig, *, add_pooling_layer: bool = True,
                 attention: AttentionSpec = None,
                 sentence_pooling: SentencePooling | None = None,
                 window_size: int | None = None, stride: int | None = None,
                 global_tokens: int | None = None) -> None:
        super().__init__()
        attention = resolve_attention(attention, window_size=window_size, stride=stride,
                                      global_tokens=global_tokens)
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        if sentence_pooling is not None and not isinstance(sentence_pooling, SentencePooling):
            raise TypeError("sentence_pooling must be a SentencePooling or None, got "
                            f"{type(sentence_pooling).__name__}")
        self.config = config
        self.sentence_pooling = sentence_pooling
        self.embeddings = BertEmbeddings(config)
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.hook_token_type_embed = HookPoint()
        self.blocks = clones(lambda: self._build_layer(attention), config.num_hidden_layers)
        self.pooler = BertPooler(config) if add_pooling_layer else None

    def _build_layer(self, attention: AttentionSpec) -> EncoderLayer:
        """The one place layers are made: every layer gets its own attention kind."""
        c = self.config
        if attention is None:
            kind = None
        elif isinstance(attention, AttentionKind):
            kind = copy.deepcopy(attention)
        elif callable(attention):
            kind = check_attention(attention())
        else:
            kind = check_attention(attention)
        layer = EncoderLayer(c.hidden_size, c.num_attention_heads, c.intermediate_size,
                             dropout=c.hidden_dropout_prob,
                             activation=HF_ACTIVATIONS[c.hidden_act], norm_first=False,
                             layer_norm_eps=c.layer_norm_eps, attention=kind)
        if layer.attn.attention.supports_dropout:
            layer.attn.dropout = c.attention_probs_dropout_prob
        return layer

    @property
    def max_positions(self) -> int:
        """The longest input (in tokens) the position table allows."""
        return self.config.max_position_embeddings

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, *,
                need_weights: bool = False) -> BertOutput:
        """Encode a batch of token ids.

        Args:
            input_ids: ``(B, L)`` integer ids, ``L <= max_positions``.
            attention_mask: ``(B, L)`` with 1 / True for real tokens and 0 for padding
                (the tokenizer's output); default all real.
            token_type_ids: ``(B, L)`` segment ids; default all 0.
            need_weights: also return every layer's attention weights.

        Returns:
            :class:`BertOutput`.

        Raises:
            TypeError: for non-integer ids.
            ValueError: for shapes that differ, inputs longer than ``max_positions`` or ids
                outside the vocabulary / type table.
        """
        self._check_ids("input_ids", input_ids, self.config.vocab_size)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        else:
            self._check_ids("token_type_ids", token_type_ids, self.config.type_vocab_size,
                            like=input_ids)
        mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != tuple(input_ids.shape):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                                 f"input_ids {tuple(input_ids.shape)}; they must match")
            if not bool(attention_mask.all()):  # no padding: no mask, fastest kernel
                mask = from_hf_attention_mask(attention_mask)  # (B, 1, 1, L)
        x = self.embed(input_ids, token_type_ids)  # (B, L, E)
        attentions = []
        for layer in self.blocks:
            x, weights = layer.forward_with_weights(x, mask, need_weights=need_weights)
            attentions.append(weights)
        pooled = self.pooler(x) if self.pooler is not None else None
        return BertOutput(x, pooled, tuple(attentions) if need_weights else None)

    def embed(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """``LayerNorm(word + position + token_type)``, then dropout: ``(B, L)`` ids and
        types (checked by :meth:`forward`) -> ``(B, L, E)``."""
        e = self.embeddings
        B, L = input_ids.shape
        positions = torch.arange(L, device=input_ids.device)  # (L,)
        x = (self.hook_embed(e.word_embeddings(input_ids))
             + self.hook_token_type_embed(e.token_type_embeddings(token_type_ids)))
        pos = e.position_embeddings(positions).expand(B, L, -1)  # (B, L, E), no copy
        x = x + self.hook_pos_embed(pos)
        return e.dropout(e.norm(x))

    def _check_ids(self, name: str, ids: Tensor, limit: int, *, like: Tensor | None = None
                   ) -> None:
        if not isinstance(ids, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
        if like is not None and tuple(ids.shape) != tuple(like.shape):
            raise ValueError(f"{name} has shape {tuple(ids.shape)}, input_ids "
                             f"{tuple(like.shape)}; they must match")
        if ids.dim() != 2:
            raise ValueError(f"{name} must be (B, L), got shape {tuple(ids.shape)}; "
                             "add a batch dim with ids.unsqueeze(0)")
        if ids.shape[1] > self.max_positions:
            raise ValueError(f"input of {ids.shape[1]} tokens is longer than the model's "
                             f"{self.max_positions} positions; truncate it (the tokenizer "
                             "does with truncation=True)")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise ValueError(f"{name} must lie in [0, {limit}), found values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")

    # ---- saving and loading ----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32,
                        attention: AttentionSpec = None, window_size: int | None = None,
                        stride: int | None = None, global_tokens: int | None = None
                        ) -> BertModel:
        """Load the model of a BERT-family folder, without a tokenizer (strict, all-or-nothing).

        The folder needs only ``config.json`` and ``model.safetensors`` (what
        :meth:`save_pretrained` writes); :func:`~handformer.pretrained.load_bert` loads the
        tokenizer too.

        Args:
            path: a folder with ``config.json`` and ``model.safetensors`` (Hugging Face key
                names, with or without a task model's ``bert.`` prefix; task heads are
                skipped; a pooler is built when the file has one), or that file.
            device: where to put the model.
            dtype: floating dtype of the parameters.
            attention: attention kind of every layer (default full), or its name; see
                :class:`BertModel`.
            window_size, stride, global_tokens: options of a kind given by name.

        Returns:
            The model, in eval mode (with the folder's sentence-transformers pooling, if any).

        Raises:
            FileNotFoundError: for a missing folder, config or weights file.
            CheckpointError: (a ``ValueError``) for pickle checkpoints (the message says how
                to convert them), truncated or corrupt files, and keys that do not match the
                config (every one listed, in the file's names); no model is returned.
            ValueError: for configs handformer does not implement, an unknown attention name
                or an option of another kind.
            TypeError: for a non-floating ``dtype`` or a bad ``attention``.
        """
        attention = check_load_options(dtype, attention, window_size=window_size,
                                       stride=stride, global_tokens=global_tokens)
        check_device(device)
        folder, weights = resolve_checkpoint_dir(path)
        config = BertConfig.from_dict(read_config_json(folder))
        header, _ = read_safetensors_header(weights)
        prefixed = any(k.startswith("bert.") for k in header)
        has_pooler = ("bert.pooler.dense.weight" if prefixed else "pooler.dense.weight") in header
        pooling = SentencePooling.from_dir(folder)
        with torch.device("meta"):  # no memory or time spent on throw-away initial weights
            model = cls(config, add_pooling_layer=has_pooler, attention=attention,
                        sentence_pooling=pooling)
        load_safetensors(model, weights, bert_key_map(prefixed), assign=True)
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (Hugging Face ``BertModel`` key
        names, so ``transformers`` reads the folder too) into ``directory``, created if
        needed. Each file is written to a temporary name and renamed: a crash never leaves a
        half-written file. No tokenizer is written: copy ``tokenizer.json`` or ``vocab.txt``
        beside them for :func:`~handformer.pretrained.load_bert`.

        Returns:
            The directory as a :class:`~pathlib.Path`.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key_map = bert_key_map(False)
        state = {key_map.file_key(k): v for k, v in self.state_dict().items()}
        save_safetensors(state, directory / WEIGHTS_NAME)
        config = {**self.config.to_dict(), "architectures": ["BertModel"]}
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        write_atomically(directory / CONFIG_NAME,
                         lambda tmp: tmp.write_text(text, encoding="utf-8"))
        return directory


def check_load_options(dtype: object, attention: object, **options: int | None
                       ) -> AttentionSpec:
    """Validate a loader's ``dtype`` and ``attention`` arguments (with the options of a kind
    given by name: ``window_size``, ``stride``, ``global_tokens``).

    Returns:
        The attention to build the layers with (see
        :func:`~handformer.attention.registry.resolve_attention`).

    Raises:
        TypeError: for a non-floating ``dtype`` or an ``attention`` that is neither a name,
            an attention kind nor a factory.
        ValueError: for an unknown name or an option that does not belong to the kind.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return resolve_attention(attention, **options)
