"""``--dictionary PATH --steer FEATURE:COEF [--at HOOK]``: steer a generation with a feature.

Shared by the commands that generate (``handformer generate``): :func:`add_steering_options`
adds the options, :func:`check_steering_flags` refuses bad ones before the model loads, and
:func:`steering` is the ``with`` block around the generation, in which every forward pass adds
``COEF · W_dec[FEATURE]`` at the hook (every position: the prompt's and each new token's), as
:func:`handformer.features.steer` does.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator

from handformer.commands.common import UsageError

__all__ = ["add_steering_options", "check_steering_flags", "parse_steer", "steering"]


def add_steering_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--dictionary``, ``--steer`` and ``--at`` to ``parser``.

    Args:
        parser: a sub-command's parser.
    """
    group = parser.add_argument_group("steering with a feature (handformer.features)")
    group.add_argument("--dictionary", metavar="PATH", default=None,
                       help="a sparse autoencoder or transcoder of this model (a folder or file "
                            "load_dictionary reads)")
    group.add_argument("--steer", metavar="FEATURE:COEF", action="append", default=None,
                       help="add COEF x the feature's decoder row at the hook, every position "
                            "(negative COEF: subtract); give it several times for several "
                            "features; needs --dictionary")
    group.add_argument("--at", metavar="HOOK", default=None,
                       help="the hook to add it at (default: where the dictionary writes, its "
                            "hook_name)")


def parse_steer(value: str) -> tuple[int, float]:
    """``"FEATURE:COEF"`` as ``(feature, coefficient)``.

    Args:
        value: the ``--steer`` text, e.g. ``"123:8.5"``.

    Raises:
        UsageError: naming ``--steer`` and the value: not two parts, a feature that is not an
            integer >= 0, a coefficient that is not a finite number.
    """
    feature, sep, coef = value.partition(":")
    if not sep:
        raise UsageError(f"--steer takes FEATURE:COEF (e.g. 123:8), got {value!r}")
    try:
        f = int(feature)
        c = float(coef)
    except ValueError:
        raise UsageError(f"--steer takes FEATURE:COEF with an integer feature and a number, "
                         f"got {value!r}") from None
    if f < 0 or not math.isfinite(c):
        raise UsageError(f"--steer {value}: the feature must be >= 0 and the coefficient a "
                         "finite number")
    return f, c


def check_steering_flags(args: argparse.Namespace) -> list[tuple[int, float]]:
    """The ``--steer`` values, checked before the model loads.

    Args:
        args: the parsed options (``dictionary``, ``steer``, ``at``).

    Returns:
        ``[(feature, coefficient), ...]``, empty without ``--steer``.

    Raises:
        UsageError: for ``--steer`` without ``--dictionary`` (or the reverse, or ``--at``
            alone), or a bad ``--steer``.
    """
    steer = [parse_steer(v) for v in args.steer or []]
    if steer and args.dictionary is None:
        raise UsageError("--steer needs --dictionary PATH (the dictionary whose feature to add)")
    if args.dictionary is not None and not steer:
        raise UsageError("--dictionary goes with --steer FEATURE:COEF")
    if args.at is not None and not steer:
        raise UsageError("--at goes with --steer FEATURE:COEF")
    return steer


@contextlib.contextmanager
def steering(args: argparse.Namespace, model: object) -> Iterator[None]:
    """Steer ``model`` for the ``with`` block as ``args`` say (nothing without ``--steer``).

    Args:
        args: the parsed options (``dictionary``, ``steer``, ``at``).
        model: the loaded model.

    Raises:
        UsageError: for a file that is no dictionary, a feature out of range, a hook the model
            does not have or one of another width than the dictionary's rows.
    """
    steer = check_steering_flags(args)
    if not steer:
        yield
        return
    import torch

    from handformer.features import load_dictionary
    from handformer.features import steer as add_feature
    from handformer.features.analysis import writes_at
    from handformer.inspect import run_with_cache

    try:
        dictionary = load_dictionary(args.dictionary)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--dictionary {args.dictionary}: {' '.join(str(exc).split())}"
                         ) from None
    if isinstance(dictionary, list):
        raise UsageError(f"--dictionary {args.dictionary}: a transcoder set (one per layer); "
                         "give one layer's file")
    param = next(model.parameters())
    dictionary = dictionary.to(device=param.device)
    try:
        at = writes_at(dictionary, args.at)
        _, cache = run_with_cache(model, torch.zeros(1, 1, dtype=torch.long,
                                                     device=param.device), names=at)
    except ValueError:
        raise UsageError("--at HOOK is needed: the dictionary does not say which hook it was "
                         "trained on") from None
    except KeyError as exc:
        raise UsageError(f"--at {args.at or at}: {exc.args[0] if exc.args else exc}") from None
    width = cache[at].shape[-1]
    if dictionary.d_out != width:
        raise UsageError(f"--dictionary {args.dictionary}: its decoder rows have "
                         f"{dictionary.d_out} dims, the model's {at} has {width}")
    with contextlib.ExitStack() as stack:
        for feature, coefficient in steer:
            if feature >= dictionary.d_sae:
                raise UsageError(f"--steer {feature}:{coefficient:g}: the dictionary has "
                                 f"{dictionary.d_sae} features (0..{dictionary.d_sae - 1})")
            stack.enter_context(add_feature(model, dictionary, feature, coefficient, at=at))
        yield
