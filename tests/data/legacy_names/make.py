"""Write the saved models of ``tests/data/legacy_names/`` (run once, then committed).

They were written by handformer at commit 008eaea (main, before issue 34's "one name per
part" renamed ``layers`` / ``self_attn`` / ``ff`` / ``norm1``... to ``blocks`` / ``attn`` /
``mlp`` / ``ln1``...), with::

    cd <checkout at 008eaea> && PYTHONPATH=src python tests/data/legacy_names/make.py

so their state-dict keys are the old module paths. ``tests/test_legacy_names.py`` loads them
with today's code and checks the outputs against ``outputs.safetensors`` (what the old code
computed on the same inputs). Running this script again with today's code would write new
names: do not, the files are a record of the old format.

Files (d_model 8, 2 layers, a few KB each):

* ``causal_lm/``: ``CausalLM.save_pretrained`` of a GPT-2-like model (learned positions,
  LayerNorm, pre-LN, final norm).
* ``causal_lm_gemma/``: the same of a Gemma-like model (RMSNorm with offset, gated MLP,
  sandwich norms, QK-norm, grouped-query attention, rotary).
* ``bert/``: ``BertModel.save_pretrained`` (Hugging Face key names, unchanged by the rename).
* ``transformer.safetensors``: the ``state_dict()`` of an encoder-decoder ``Transformer``
  (post-LN, cross-attention, both final norms), as a user saves one with ``safetensors``.
* ``run/``: ``handformer train copy`` for 2 steps, its last checkpoint kept (resumable).
* ``outputs.safetensors``: the old code's outputs on fixed inputs (``INPUTS`` below).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from handformer import CausalLM, CausalLMConfig, Transformer
from handformer.pretrained import BertConfig, BertModel
from handformer.weights import save_safetensors

HERE = Path(__file__).resolve().parent


def inputs() -> dict[str, torch.Tensor]:
    """The fixed inputs the outputs are computed on (the test builds the same)."""
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, 11, (2, 5), generator=g),
            "src": torch.randn(2, 4, 8, generator=g),
            "tgt": torch.randn(2, 3, 8, generator=g)}


def gpt2_config() -> CausalLMConfig:
    return CausalLMConfig(vocab_size=11, max_len=16, d_model=8, num_heads=2, num_layers=2,
                          d_ff=16, dropout=0.0, norm_first=True)


def gemma_config() -> CausalLMConfig:
    return CausalLMConfig(vocab_size=11, max_len=16, d_model=8, num_heads=2, num_layers=2,
                          d_ff=16, dropout=0.0, norm_first=True, positional="rotary",
                          norm="rms", norm_offset=1.0, mlp="gated", activation="gelu_tanh",
                          sandwich_norm=True, qk_norm=True, num_kv_heads=1, bias=False)


def main() -> None:
    torch.manual_seed(0)
    x = inputs()
    outputs = {}
    for name, config in (("causal_lm", gpt2_config()), ("causal_lm_gemma", gemma_config())):
        model = CausalLM(config).eval()
        with torch.no_grad():  # non-trivial norm weights (init is ones / zeros)
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(HERE / name)
        with torch.no_grad():
            outputs[name] = model(x["ids"]).logits
    bert = BertModel(BertConfig(vocab_size=11, hidden_size=8, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=16,
                                max_position_embeddings=16)).eval()
    bert.save_pretrained(HERE / "bert")
    with torch.no_grad():
        outputs["bert"] = bert(x["ids"]).last_hidden_state
    tf = Transformer(d_model=8, num_heads=2, num_encoder_layers=2, num_decoder_layers=2,
                     d_ff=16, dropout=0.0).eval()
    with torch.no_grad():
        for p in tf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_safetensors(tf.state_dict(), HERE / "transformer.safetensors")
    with torch.no_grad():
        outputs["transformer"] = tf(x["src"], x["tgt"]).last_hidden_state
    run = HERE / "run"
    shutil.rmtree(run, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "handformer", "train", "copy", "--out", str(run),
                    "--layers", "2", "--d-model", "8", "--heads", "2", "--d-ff", "16",
                    "--length", "3", "--num-symbols", "4", "--steps", "2",
                    "--batch-size", "4", "--ckpt-every", "1", "--eval-every", "1",
                    "--eval-size", "4", "--keep", "1", "--no-progress", "--threads", "1"],
                   check=True)
    for png in run.glob("*.png"):  # plots: not needed, and the largest files
        png.unlink()
    with torch.no_grad():
        ids = torch.randint(0, CausalLM.from_pretrained(run).config.vocab_size, (2, 5),
                            generator=torch.Generator().manual_seed(1))
        outputs["run"] = CausalLM.from_pretrained(run)(ids).logits
    outputs["run_ids"] = ids
    save_safetensors(outputs, HERE / "outputs.safetensors")


if __name__ == "__main__":
    main()
