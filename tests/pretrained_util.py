"""Helpers for the pretrained tests: tiny random BERT checkpoints written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

WORDS = ("the a cat dog sat on mat ran fast slow red blue big small house tree bird sings "
         "loud quiet ##s ##ing ##ed").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(folder: Path, vocab_size: int) -> list[str]:
    """A WordPiece ``vocab.txt`` of ``vocab_size`` entries (specials, words, fillers)."""
    vocab = SPECIALS + WORDS
    vocab += [f"tok{i}" for i in range(vocab_size - len(vocab))]
    (folder / "vocab.txt").write_text("\n".join(vocab[:vocab_size]) + "\n", encoding="utf-8")
    return vocab[:vocab_size]


def tiny_checkpoint(folder: Path, *, hidden_size: int = 32, layers: int = 2, heads: int = 4,
                    intermediate: int = 37, max_positions: int = 64, pooler: bool = True,
                    masked_lm: bool = False, hidden_act: str = "gelu", eps: float = 1e-7,
                    seed: int = 0) -> transformers.BertModel:
    """Save a random ``transformers`` BERT (every parameter random) with a vocab.txt.

    Returns the reference ``BertModel`` (eager attention, eval mode).
    """
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=hidden_size, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=intermediate,
        max_position_embeddings=max_positions, hidden_act=hidden_act, layer_norm_eps=eps,
        attn_implementation="eager")
    if masked_lm:
        full = transformers.BertForMaskedLM(config)
        model = full.bert
    else:
        full = model = transformers.BertModel(config, add_pooling_layer=pooler)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.3)
    full.save_pretrained(folder, safe_serialization=True)
    write_vocab(folder, 64)
    return model.eval()


def state_hash(model: torch.nn.Module) -> dict[str, bytes]:
    """A copy of every parameter's bytes, to prove that nothing changed."""
    return {k: v.detach().clone().numpy().tobytes() for k, v in model.state_dict().items()}


def tiny_gpt2_folder(folder: Path, *, n_layer: int = 1, vocab_size: int = 40) -> Path:
    """Save a random ``transformers`` GPT-2 (n_embd 16, 2 heads, 32 positions) with a
    word-level ``tokenizer.json`` of ``w0 .. w{V-2}`` and ``<|endoftext|>`` (id ``V - 1``)."""
    import warnings

    from tokenizers import Tokenizer, models, pre_tokenizers

    eos = vocab_size - 1
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=16,
                                     n_layer=n_layer, n_head=2, bos_token_id=eos,
                                     eos_token_id=eos, initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<|endoftext|>": eos}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder
