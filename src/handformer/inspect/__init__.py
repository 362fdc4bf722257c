"""Look inside a model: hook points, activation cache, ablation and patching.

Every handformer model passes its intermediate tensors through named hook points
(TransformerLens names: ``blocks.{i}.attn.hook_pattern``, ``blocks.{i}.hook_resid_post``, ...;
:func:`hook_names` lists them). :func:`run_with_cache` keeps them, :func:`run_with_hooks` and
:func:`hooks` read or replace them, :mod:`~handformer.inspect.ablation` sweeps heads.
:func:`attention_rollout` and :func:`attention_flow` follow attention down to the input tokens
(Abnar & Zuidema 2020); :func:`faithfulness` sets them beside token ablation;
:func:`logit_lens` and :func:`similarity_lens` read every layer in the output space.
The cache's direct logit attribution (``cache.decompose_resid()``, ``cache.logit_attrs(...)``,
:mod:`~handformer.inspect.attribution`), :func:`detect_heads` (:func:`detection_scores` for
patterns you have) and :func:`attribution_patching` look inside causal language models.
:func:`compare_runs` sets two models side by side, hook point by hook point (a quantized
model against its float32 original).
This package stands on the models and knows nothing of pictures (:mod:`handformer.viz`
draws what it computes).
"""

from handformer.hooks import HookError, HookPoint
from handformer.inspect.ablation import (
    head_ablation_hooks,
    head_ablation_sweep,
    head_means,
    patching_sweep,
)
from handformer.inspect.act_names import act_name
from handformer.inspect.attr_patching import attribution_patching
from handformer.inspect.compare import PointDiff, RunComparison, compare_runs
from handformer.inspect.detect import (
    detect_heads,
    detection_pattern,
    detection_scores,
    perfect_score,
)
from handformer.inspect.faithfulness import Faithfulness, faithfulness, spearman
from handformer.inspect.flow import attention_flow
from handformer.inspect.lens import (
    LogitLens,
    SimilarityLens,
    lens_logits,
    logit_lens,
    similarity_lens,
)
from handformer.inspect.points import attention_layers, hook_names, hook_points
from handformer.inspect.prompt import (
    AnswerRank,
    test_prompt,
    to_single_token,
    to_str_tokens,
    to_tokens,
)
from handformer.inspect.rollout import attention_rollout, residual_attention
from handformer.inspect.run import (
    ActivationCache,
    hooks,
    run_with_cache,
    run_with_hooks,
    short_name,
)

__all__ = [
    "HookError",
    "HookPoint",
    "hook_names",
    "hook_points",
    "attention_layers",
    "hooks",
    "run_with_hooks",
    "run_with_cache",
    "ActivationCache",
    "short_name",
    "act_name",
    "head_ablation_hooks",
    "head_ablation_sweep",
    "head_means",
    "patching_sweep",
    "attribution_patching",
    "compare_runs",
    "RunComparison",
    "PointDiff",
    "detect_heads",
    "detection_pattern",
    "detection_scores",
    "perfect_score",
    "test_prompt",
    "AnswerRank",
    "to_str_tokens",
    "to_tokens",
    "to_single_token",
    "attention_rollout",
    "residual_attention",
    "attention_flow",
    "faithfulness",
    "Faithfulness",
    "spearman",
    "logit_lens",
    "lens_logits",
    "LogitLens",
    "similarity_lens",
    "SimilarityLens",
]
