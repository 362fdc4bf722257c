"""``handformer generate --dictionary PATH --steer FEATURE:COEF [--at HOOK]``: a tiny causal LM
and a dictionary the test builds, whose feature's decoder row is a token's unembedding
direction: steered hard enough, the model writes that token and nothing else."""

from __future__ import annotations

import pytest
import torch

from cli_util import run_cli
from handformer.features import SparseAutoencoder, save_dictionary
from handformer.train.data import CharVocab
from serve_util import causal_folder

HOOK = "blocks.1.hook_resid_post"
PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("steer")
    folder = causal_folder(root / "model")
    import handformer as hf

    model = hf.CausalLM.from_pretrained(folder)
    vocab = CharVocab.load(folder / "vocab.json")
    target = vocab.encode("z")[0]
    torch.manual_seed(3)
    sae = SparseAutoencoder(32, 16, activation="relu", hook_name=HOOK)
    with torch.no_grad():
        sae.W_dec.normal_(0, 0.1)
        row = model.lm_head.weight[target]  # (E,) the token's unembedding
        # The final norm is a LayerNorm: it removes the mean; keep the part it passes.
        sae.W_dec[5] = (row - row.mean()) / (row - row.mean()).norm()
    save_dictionary(sae, root / "sae")
    return folder, root / "sae"


def generate(capsys, folder, *extra):
    return run_cli(capsys, ["generate", "--model", str(folder), "--prompt", PROMPT,
                            "--max-new-tokens", "6", *extra])


def test_a_large_coefficient_on_an_aligned_feature_writes_its_token(capsys, files):
    folder, sae = files
    code, plain, _ = generate(capsys, folder)
    assert code == 0 and plain.startswith(PROMPT)
    assert plain.strip() != PROMPT + "zzzzzz"  # the model does not say it by itself
    code, steered, _ = generate(capsys, folder, "--dictionary", str(sae), "--steer", "5:300")
    assert code == 0 and steered.strip() == PROMPT + "zzzzzz"
    # The same feature at another hook (--at) steers too; a small coefficient barely does.
    code, at0, _ = generate(capsys, folder, "--dictionary", str(sae), "--steer", "5:300",
                            "--at", "blocks.0.hook_resid_post")
    assert code == 0 and at0.count("z") >= 3
    code, gentle, _ = generate(capsys, folder, "--dictionary", str(sae), "--steer", "5:0.01")
    assert code == 0 and gentle == plain


@pytest.mark.parametrize("extra,words", [
    (["--steer", "5:300"], "--steer needs --dictionary"),
    (["--dictionary", "x"], "--dictionary goes with --steer"),
    (["--dictionary", "SAE", "--steer", "5"], "FEATURE:COEF"),
    (["--dictionary", "SAE", "--steer", "five:3"], "integer feature"),
    (["--dictionary", "SAE", "--steer", "5:nan"], "finite"),
    (["--dictionary", "SAE", "--steer", "16:1"], "16 features"),
    (["--dictionary", "SAE", "--steer", "1:1", "--at", "blocks.7.hook_resid_post"],
     "--at blocks.7.hook_resid_post"),
    (["--dictionary", "SAE", "--steer", "1:1", "--at", "blocks.0.attn.hook_pattern"],
     "dims"),
    (["--dictionary", "MODEL", "--steer", "1:1"], "--dictionary"),
])
def test_bad_steering_options_are_one_line_errors(capsys, files, extra, words):
    folder, sae = files
    extra = [str(sae) if a == "SAE" else str(folder) if a == "MODEL" else a for a in extra]
    code, _, err = generate(capsys, folder, *extra)
    assert code == 2 and words in err, err
