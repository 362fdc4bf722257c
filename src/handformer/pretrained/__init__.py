"""Pretrained checkpoints on handformer's own layers: BERT-family encoders, a tokenizer,
sentence embeddings, and the strict safetensors loader they share.

    model, tokenizer = load_bert()                 # bundled all-MiniLM-L6-v2
    enc = tokenizer(["a sentence", "another one"])
    out = model(**enc, need_weights=True)          # last_hidden_state, attentions
    vectors = embed(["a sentence", "another one"])
    lm, tok = load_lm("path/to/llama-folder")     # GPT-2, Llama, Mistral, Qwen, Gemma; GGUF
"""

from handformer.pretrained.bert import BertConfig, BertModel, BertOutput, bert_key_map
from handformer.pretrained.checkpoints import bundled_model_dir, load_bert
from handformer.pretrained.embed import embed
from handformer.pretrained.gpt2 import load_gpt2
from handformer.pretrained.lm import build_causal_lm, load_lm
from handformer.pretrained.pooling import SentencePooling
from handformer.tokenizers.byte_bpe import TextTokenizer
from handformer.tokenizers.lm import LMTokenizer
from handformer.tokenizers.protocol import Tokenizer
from handformer.tokenizers.wordpiece import BertTokenizer
from handformer.weights import CheckpointError, LoadReport, load_safetensors

__all__ = [
    "BertConfig",
    "BertModel",
    "BertOutput",
    "BertTokenizer",
    "CheckpointError",
    "LMTokenizer",
    "LoadReport",
    "SentencePooling",
    "TextTokenizer",
    "Tokenizer",
    "bert_key_map",
    "build_causal_lm",
    "bundled_model_dir",
    "embed",
    "load_bert",
    "load_gpt2",
    "load_lm",
    "load_safetensors",
]
