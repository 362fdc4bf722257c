"""``handformer demo``: a small, real run of an encoder on a sentence of token ids."""

from __future__ import annotations

import argparse

import torch

NAME = "demo"
HELP = "Run a tiny random encoder on the seed's sentence and print shapes and one head."

SENTENCE = "The animal didn't cross the street because it was too tired".split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed, 0 to 2**63 - 1 (default 0)")


def run(args: argparse.Namespace) -> int:
    from handformer import Encoder, EncoderLayer, SinusoidalPositionalEncoding
    from handformer.checks import OptionError, check_seed
    from handformer.commands.common import flag_error

    try:
        check_seed(args.seed)  # one rule for every seed (0 .. 2**63 - 1)
    except OptionError as exc:
        raise flag_error(exc) from None
    torch.manual_seed(args.seed)
    vocab = {w: i for i, w in enumerate(dict.fromkeys(SENTENCE))}
    ids = torch.tensor([[vocab[w] for w in SENTENCE]])  # (1, L)
    embed = torch.nn.Embedding(len(vocab), 64)
    pos = SinusoidalPositionalEncoding(64)
    encoder = Encoder(EncoderLayer(64, 4, 128, dropout=0.0), 2).eval()
    with torch.no_grad():
        out = encoder(pos(embed(ids)), need_weights=True)
    print(f"token ids        {tuple(ids.shape)}")
    print(f"hidden states    {tuple(out.last_hidden_state.shape)}")
    print(f"attentions       {len(out.attentions)} x {tuple(out.attentions[0].shape)}")
    weights = out.attentions[-1][0, 0]  # (L, L)
    width = max(len(w) for w in SENTENCE)
    print(f"\nlayer {len(out.attentions) - 1}, head 0 (random weights; rows sum to 1):")
    print(" " * (width + 1) + " ".join(f"{w[:5]:>5}" for w in SENTENCE))
    for word, row in zip(SENTENCE, weights.tolist(), strict=True):
        print(f"{word:>{width}} " + " ".join(f"{x:5.2f}" for x in row))
    return 0
