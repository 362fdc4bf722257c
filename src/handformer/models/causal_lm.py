"""A decoder-only language model (GPT-2's architecture, and its variants) on handformer layers.

Shape letters: ``B`` batch, ``L`` length (new tokens), ``E`` model dim, ``V`` vocabulary.

Reads top to bottom: token embedding (times ``embed_scale``, Gemma) + positions (learned,
sinusoidal, or rotary inside the attention) -> ``num_layers`` causal
:class:`~handformer.DecoderLayer` blocks without cross-attention (each with its attention
kind and rotary embedding: full or sliding-window layers, ``layer_types``) -> final norm
(pre-norm models; LayerNorm or RMSNorm) -> LM head (optionally tied to the token embedding)
-> optional final-logit soft-cap (Gemma 2). Positions count real tokens only, so left-padded
prompts get the positions they would have alone. The configuration is a
:class:`CausalLMConfig` saved as ``config.json`` beside ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from handformer.attention.cache import DecodingCache, cache_for
from handformer.attention.functional import soft_cap
from handformer.checks import check_non_negative_int, mkstemp_beside
from handformer.decoder_layer import DecoderLayer
from handformer.hooks import HookPoint
from handformer.layers import Dropout
from handformer.legacy_names import LegacyNames
from handformer.masks import from_hf_attention_mask
from handformer.models.causal_lm_config import CausalLMConfig
from handformer.models.plain_step import PlainDecodeStep
from handformer.norms import make_norm
from handformer.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from handformer.positional_rotary import RotaryEmbedding, shared_tables
from handformer.weight_views import CausalLMViews
from handformer.weights import load_safetensors

__all__ = ["CausalLM", "CausalLMConfig", "CausalLMOutput", "MODEL_TYPE"]

MODEL_TYPE = "handformer-causal-lm"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class CausalLMOutput:
    """What :meth:`CausalLM.forward` returns.

    Attributes:
        logits: ``(B, L, V)`` next-token scores for every input position.
        attentions: one ``(B, H, L, L_k)`` tensor per layer when ``need_weights=True``.
        cache: the decoding cache that was passed in (now advanced), or None.
    """

    logits: Tensor
    attentions: tuple[Tensor, ...] | None = None
    cache: DecodingCache | None = None


class CausalLM(LegacyNames, CausalLMViews, nn.Module):
    """Decoder-only Transformer language model.

    TransformerLens' names read its weights, as read-only views (no copies):
    ``model.W_E``, ``W_U``, ``W_pos``, ``model.blocks[l].attn.W_Q`` ... ``b_O``,
    ``model.blocks[l].mlp.W_in`` / ``W_gate`` / ``W_out``, and ``model.cfg`` (see
    :mod:`handformer.weight_views`).

    Submodules: ``tok_emb``, ``pos_emb`` (None with rotary positions), ``blocks`` (the
    :class:`~handformer.DecoderLayer` s), ``ln_final`` (None for post-LN models),
    ``lm_head``: each module's path is its hook name (``blocks.0.attn.hook_pattern``).

    Args:
        config: a :class:`CausalLMConfig`.

    Raises:
        TypeError: if ``config`` is not a :class:`CausalLMConfig`.
    """

    LEGACY_NAMES = {"layers": "blocks", "norm": "ln_final"}  # handformer.legacy_names

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        if not isinstance(config, CausalLMConfig):
            raise TypeError(f"config must be a CausalLMConfig, got {type(config).__name__}")
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        if c.positional == "learned":
            self.pos_emb = LearnedPositionalEmbedding(c.max_len, c.d_model)
        elif c.positional == "sinusoidal":
            self.pos_emb = SinusoidalPositionalEncoding(c.d_model, max_len=c.max_len)
        else:
            self.pos_emb = None
        rotary = local_rotary = None
        if c.positional == "rotary":
            freq_dtype = torch.float32 if c.rotary_freq_dtype == "float32" else torch.float64
            rotary = local_rotary = RotaryEmbedding(c.head_dim, base=c.rotary_base,
                                                    scaling=c.rotary_scaling,
                                                    freq_dtype=freq_dtype)
            if c.rotary_local_base is not None:
                local_rotary = RotaryEmbedding(c.head_dim, base=c.rotary_local_base,
                                               freq_dtype=freq_dtype)
        self.drop = Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            DecoderLayer(c.d_model, c.num_heads, c.d_ff, dropout=c.dropout,
                         activation=c.activation, norm_first=c.norm_first,
                         layer_norm_eps=c.layer_norm_eps, bias=c.bias,
                         attention=c.make_attention(i), cross_attention=False,
                         rotary=local_rotary if c.layer_type(i) == "local" else rotary,
                         norm=c.norm, norm_offset=c.norm_offset, mlp=c.mlp,
                         mlp_bias=c.mlp_bias, sandwich_norm=c.sandwich_norm,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                         qkv_bias=c.qkv_bias, out_bias=c.out_bias, qk_norm=c.qk_norm,
                         attn_scale=c.attn_scale)
            for i in range(c.num_layers)
        )
        self.ln_final = (make_norm(c.norm, c.d_model, eps=c.layer_norm_eps,
                                   offset=c.norm_offset, bias=c.bias)
                         if c.norm_first else None)  # hook point ln_final.hook_normalized
        self.hook_embed = HookPoint()  # token embeddings (B, L, E), times embed_scale
        if c.positional in ("learned", "sinusoidal"):
            self.hook_pos_embed = HookPoint()  # position embeddings (B, L, E)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(_init_weights)
        if c.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    # ---- running ---------------------------------------------------------------------------

    def new_cache(self, *, capacity: int | None = None, static: bool = False) -> DecodingCache:
        """An empty decoding cache: one layer cache per layer, of the kind its attention needs
        (KV for full/strided, rolling window for local, (S, z) state for linear).

        Args:
            capacity: tokens the KV caches allocate room for at the first call, written in
                place from then on (None: they start small and grow by doubling); at most
                ``max_len``.
            static: full attention gets fixed-shape caches of ``capacity`` tokens
                (:class:`~handformer.attention.cache.StaticKVCache`), what a compiled
                decoding step needs (``generate(..., compile=True)``).

        Raises:
            ValueError: for a ``capacity`` that is not an integer in ``[1, max_len]``, or
                ``static=True`` without one.
        """
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or not 1 <= capacity <= self.config.max_len):
            raise ValueError(f"capacity must be an integer in [1, max_len={self.config.max_len}]"
                             f", got {capacity!r}")
        return DecodingCache([cache_for(layer.attn.attention, capacity=capacity,
                                        static=static) for layer in self.blocks])

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                cache: DecodingCache | None = None, need_weights: bool = False,
                logits_to_keep: int = 0) -> CausalLMOutput:
        """Next-token logits for every position (or the last ``logits_to_keep``).

        Args:
            input_ids: ``(B, L)`` integer token ids (the new tokens when a cache is given).
            attention_mask: ``(B, L)`` 1/0 (or bool), 1 = real token, for the tokens in
                ``input_ids`` only (the cache remembers earlier ones). Use it for left
                padding: padded positions neither attend nor are attended to, and positions
                count real tokens only.
            cache: a :meth:`new_cache` to continue from and advance (incremental decoding).
            need_weights: return every layer's attention weights.
            logits_to_keep: compute the logits of the last ``logits_to_keep`` positions only,
                ``(B, logits_to_keep, V)`` (as transformers' argument of that name); 0: all.
                A prompt before decoding needs the last one: the LM head of a
                49,152-token vocabulary over a 1,024-token prompt is a third of the pass.

        Returns:
            :class:`CausalLMOutput`.

        Raises:
            TypeError: for non-integer ids.
            ValueError: for ids out of range, wrong shapes, a mask that is not 1/0, a cache
                of another model or batch size, more tokens than ``max_len``, or a
                ``logits_to_keep`` that is not an integer >= 0.
        """
        B, L = self._check_ids(input_ids)
        check_non_negative_int("logits_to_keep", logits_to_keep)
        keep = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (B, L):
                hint = "; with a cache it covers the new tokens only" if cache is not None else ""
                raise ValueError(f"attention_mask must be (B, L) = {(B, L)} like input_ids, "
                                 f"got {tuple(attention_mask.shape)}{hint}")
            keep = from_hf_attention_mask(attention_mask).reshape(B, L)  # (B, L) bool
            keep = keep.to(input_ids.device)
        past, start = self._check_cache(cache, B, L, input_ids.device)
        if keep is None:
            positions = start[:, None] + torch.arange(L, device=input_ids.device)  # (B, L)
        else:
            positions = (start[:, None] + keep.long().cumsum(1) - 1).clamp(min=0)  # (B, L)
        logits, attentions = self.run(input_ids, positions, keep=keep, cache=cache,
                                      need_weights=need_weights, logits_to_keep=logits_to_keep)
        if cache is not None:
            cache.seen = past + L
            cache.next_positions = start + (L if keep is None else keep.long().sum(1))
        return CausalLMOutput(logits, attentions, cache)

    def run(self, input_ids: Tensor, positions: Tensor, *, keep: Tensor | None = None,
            cache: DecodingCache | None = None, need_weights: bool = False,
            logits_to_keep: int = 0) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """The forward pass proper, on inputs already checked: embeddings, layers, head.

        :meth:`forward` checks its arguments, works out the positions and advances the
        cache's counters around this; :meth:`decode_step` (what ``generate`` runs for every
        new token) calls it directly, and ``generate(..., compile=True)`` compiles it.

        Args:
            input_ids: ``(B, L)`` token ids.
            positions: ``(B, L)`` position of each token.
            keep: ``(B, L)`` bool, False on padding (None = all real).
            cache: the decoding cache; its layer caches are fed, its counters not touched.
            need_weights: also return every layer's attention weights.
            logits_to_keep: the LM head on the last ``logits_to_keep`` positions only (0: all).

        Returns:
            ``(logits, attentions)``: ``(B, L, V)`` (``L = logits_to_keep`` if given) and a
            tuple of per-layer weights (or None).
        """
        x = self.tok_emb(input_ids)  # (B, L, E)
        if self.config.embed_scale is not None:  # rounded to the dtype, as the references do
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        x = self.hook_embed(x)
        if isinstance(self.pos_emb, LearnedPositionalEmbedding):
            # embedding() is index_select: one op, where weight[positions] is a gather
            x = x + self.hook_pos_embed(F.embedding(positions, self.pos_emb.weight))  # (B, L, E)
        elif isinstance(self.pos_emb, SinusoidalPositionalEncoding):
            x = x + self.hook_pos_embed(F.embedding(positions, self.pos_emb.pe).to(x.dtype))
        x = self.drop(x)
        mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, L)
        if torch.compiler.is_compiling():  # (a compiled graph computes the tables once anyway)
            x, attentions = self._layers(x, mask, positions, cache, need_weights)
        else:
            with shared_tables():  # one rotary cos/sin table per forward pass, not per layer
                x, attentions = self._layers(x, mask, positions, cache, need_weights)
        if self.ln_final is not None:
            x = self.ln_final(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # (B, logits_to_keep, E)
        logits = soft_cap(self.lm_head(x), self.config.final_softcap)  # (B, L, V)
        return logits, (tuple(attentions) if need_weights else None)

    def run_from(self, resid: Tensor, positions: Tensor, *, start: int) -> Tensor:
        """The rest of a forward pass from block ``start``'s input: the logits ``(B, L, V)``.

        TransformerLens' ``start_at_layer``: blocks ``start..`` run (their hooks with them),
        then the final norm and the head. For patching and ablation at a late layer, the
        layers before it need not run again: a dictionary's evaluation splices it in three
        ways per batch (:func:`handformer.features.evaluate_dictionaries`).

        Args:
            resid: ``(B, L, E)``: what ``blocks.{start}.hook_resid_pre`` held (for ``start``
                equal to the number of blocks, the last block's ``hook_resid_post``).
            positions: ``(B, L)`` token positions (``arange(L)`` for unpadded windows).
            start: the first block to run, ``0 <= start <= len(blocks)``.

        Returns:
            ``(B, L, V)`` logits (after the final soft-cap, as :meth:`forward`'s).

        Raises:
            ValueError: for ``start`` outside ``[0, len(blocks)]``.
        """
        n = len(self.blocks)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= n:
            raise ValueError(f"start must be an int in [0, {n}] (the blocks), got {start!r}")
        with shared_tables():
            for layer in self.blocks[start:]:
                resid, _, _ = layer.forward_with_weights(resid, causal=True, need_weights=False,
                                                         positions=positions)
        if self.ln_final is not None:
            resid = self.ln_final(resid)
        return soft_cap(self.lm_head(resid), self.config.final_softcap)  # (B, L, V)

    def _layers(self, x: Tensor, mask: Tensor | None, positions: Tensor,
                cache: DecodingCache | None, need_weights: bool
                ) -> tuple[Tensor, list[Tensor | None]]:
        """The decoder layers in turn: ``(B, L, E)`` -> ``(B, L, E)`` and their weights."""
        attentions = []
        for i, layer in enumerate(self.blocks):
            x, weights, _ = layer.forward_with_weights(
                x, mask=mask, causal=True, need_weights=need_weights,
                cache=None if cache is None else cache.layers[i], positions=positions,
            )
            attentions.append(weights)
        return x, attentions

    def decode_step(self, input_ids: Tensor, cache: DecodingCache,
                    run: Callable[..., tuple[Tensor, object]] | None = None) -> Tensor:
        """One decoding step for trusted inputs: the next-token logits ``(B, V)``.

        For loops that checked their inputs once (``generate`` does): none of
        :meth:`forward`'s per-call checks run (ids in range, a cache of this model and batch,
        the context length), so call :meth:`forward` for anything else. ``input_ids`` are
        real tokens (no padding) following what ``cache`` holds; the cache advances.

        Args:
            input_ids: ``(B, L)`` new token ids, usually ``L = 1``.
            cache: the cache of the earlier tokens (at least one :meth:`forward` call).
            run: what computes the logits, :meth:`run` by default (``generate`` passes a
                compiled one).

        Returns:
            ``(B, V)`` logits of the last new token.
        """
        L = input_ids.shape[1]
        start = cache.next_positions  # (B,)
        if L == 1:
            positions = start[:, None]  # (B, 1), a view: no op
        else:
            positions = start[:, None] + torch.arange(L, device=start.device)  # (B, L)
        logits, _ = (run or self.run)(input_ids, positions, cache=cache)
        cache.seen += L
        cache.next_positions = start + L
        return logits[:, -1]

    def plain_decode_step(self, cache: DecodingCache) -> PlainDecodeStep | None:
        """The decoding step as plain tensor functions, for this model and a ``cache`` the
        prompt filled: what ``generate`` runs for each new token (see
        :mod:`handformer.models.plain_step`).

        Returns:
            A :class:`~handformer.models.plain_step.PlainDecodeStep`, or None where it does
            not apply (another attention kind, PyTorch forward hooks, training mode, a
            subclass that overrides :meth:`run` or :meth:`decode_step`): then
            :meth:`decode_step` is the step.
        """
        if type(self).run is not CausalLM.run or type(self).decode_step is not CausalLM.decode_step:
            return None
        return PlainDecodeStep.build(self, cache)

    def _check_ids(self, input_ids: Tensor) -> tuple[int, int]:
        if not isinstance(input_ids, Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be (B, L) with L >= 1, got shape "
                             f"{tuple(input_ids.shape)}")
        # The range check reads the ids (data-dependent): skipped inside torch.compile, where
        # an out-of-range id still fails in the embedding lookup.
        if input_ids.numel() and not torch.compiler.is_compiling():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), found "
                                 f"ids from {lo} to {hi}")
        return input_ids.shape[0], input_ids.shape[1]

    def _check_cache(self, cache: DecodingCache | None, B: int, L: int,
                     device: torch.device) -> tuple[int, Tensor]:
        """Tokens already in the cache and each sequence's next position ``(B,)``."""
        past = 0
        start = torch.zeros(B, dtype=torch.long, device=device)
        if cache is not None:
            if not isinstance(cache, DecodingCache) or len(cache) != len(self.blocks):
                raise ValueError(f"cache must be this model's new_cache() "
                                 f"({len(self.blocks)} layers), got {cache!r:.80}")
            past = cache.seen
            if cache.next_positions is not None:
                if cache.next_positions.shape[0] != B:
                    raise ValueError(f"the cache holds a batch of "
                                     f"{cache.next_positions.shape[0]}, input_ids has {B}")
                start = cache.next_positions.to(device)
        if past + L > self.config.max_len:
            raise ValueError(f"{past + L} tokens ({past} cached + {L} new) exceed the context "
                             f"max_len={self.config.max_len}")
        return past, start

    # ---- generation ------------------------------------------------------------------------

    def generate(self, input_ids: Tensor, **kwargs: object) -> Tensor:
        """Generate tokens after ``input_ids``; see :func:`handformer.models.generation.generate`
        for the arguments (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
        ``top_p``, ``eos_token_id``, ``attention_mask``, ``generator``, ``use_cache``,
        ``streamer``)."""
        from handformer.models.generation import generate

        return generate(self, input_ids, **kwargs)

    # ---- saving and loading ----------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if
        needed). Each file is written to a temporary name and renamed, so a crash never
        leaves a half-written file. A tied LM head is stored once (as ``tok_emb.weight``).

        Returns:
            The directory as a :class:`~pathlib.Path`.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous()
                 for k, v in self.state_dict().items()
                 if not (self.config.tie_weights and k == "lm_head.weight")}
        _atomic_write(directory / WEIGHTS_NAME,
                      lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
        config = {"model_type": MODEL_TYPE, **self.config.to_dict()}
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        _atomic_write(directory / CONFIG_NAME, lambda tmp: tmp.write_text(text))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> CausalLM:
        """Load a model written by :meth:`save_pretrained` (strict, all-or-nothing).

        Args:
            directory: folder with ``config.json`` and ``model.safetensors``.
            device: where to put the model.
            dtype: floating dtype of the parameters.

        Returns:
            The model, in eval mode.

        Raises:
            FileNotFoundError: for a missing folder or file.
            ValueError: for an invalid config; ``CheckpointError`` (a ``ValueError``) for
                missing, unexpected or mis-shaped weights and corrupt files.
        """
        directory = Path(directory)
        config = read_config(directory / CONFIG_NAME)
        model = cls(config)
        load_safetensors(model, directory / WEIGHTS_NAME)
        return model.to(device=device, dtype=dtype).eval()


def read_config(path: Path) -> CausalLMConfig:
    """Read a CausalLM ``config.json``.

    Raises:
        FileNotFoundError: if it does not exist.
        ValueError: if it is not JSON, not a CausalLM config, or invalid.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent} (a CausalLM folder has "
                                f"{CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        found = data.get("model_type") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: model_type is {found!r}, expected {MODEL_TYPE!r}; a GPT-2 "
                         "folder loads with handformer.pretrained.load_gpt2")
    data = {k: v for k, v in data.items() if k != "model_type"}
    return CausalLMConfig.from_dict(data)


def _atomic_write(path: Path, write: object) -> None:
    """Call ``write(tmp_path)`` then rename the temporary file over ``path``."""
    tmp = mkstemp_beside(path)  # a missing folder is named, not the temporary file
    try:
        write(Path(tmp))  # type: ignore[operator]
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
