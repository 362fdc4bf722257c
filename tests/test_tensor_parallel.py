"""Tensor parallel (handformer.distributed) on two gloo ranks equals one process.

One ``torchrun --nproc_per_node 2`` job runs the script below. Each rank builds the same tiny
models, computes every result on the whole model (one process's answer, before anything is
sharded), then on the sharded one, and saves both; the test compares them (float32, 1e-5):
logits, attention weights, every hook point of ``run_with_cache``, decoding with a cache,
a head-ablation sweep, a patch at a global head index and greedy generation. Three shapes:
grouped-query attention split evenly (4 heads, 2 KV heads, tied vocabulary sharded), an
uneven head count (5 heads: 3/2, GPT-2 style with biases, an untied vocabulary sharded), and
SmolLM2's shape (9 heads 5/4, 3 KV heads: a group cut between the ranks; replicated
vocabulary). Then ``load_lm(..., mesh=mesh)`` reads
its slices of a safetensors folder and of a Q8_0 GGUF file (columns of half a block), and a
rank whose copy of the file is damaged stops both ranks with one line naming it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import handformer as hf
from handformer.distributed import kv_heads_for, parallelize, split_evenly, vocab_range

SCRIPT = r'''
import copy, datetime, json, shutil, sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

import handformer as hf
from handformer.distributed import parallelize, shards
from handformer.inspect import (attribution_patching, head_ablation_hooks, head_ablation_sweep,
                                run_with_cache, run_with_hooks)
from handformer.pretrained import load_lm

sys.path.insert(0, sys.argv[2])  # tests/, for gguf_util
from gguf_util import tiny_llama_gguf

torch.set_num_threads(1)
out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
CASES = {
    "gqa": (dict(num_heads=4, num_kv_heads=2, positional="rotary", norm="rms", mlp="gated",
                 activation="silu", bias=False, tie_weights=True, qk_norm=True), "shard"),
    "uneven": (dict(num_heads=5, d_model=40, tie_weights=False), "shard"),
    "smollm2": (dict(num_heads=9, num_kv_heads=3, d_model=36, positional="rotary",
                     norm="rms", mlp="gated", activation="silu", bias=False,
                     tie_weights=True), "replicate"),
}


def results(model, ids, mask):
    r = {}
    o = model(ids, attention_mask=mask, need_weights=True)
    r["logits"], r["attn"] = o.logits, torch.stack(o.attentions)
    _, c = run_with_cache(model, ids)
    r.update({"cache." + k: v for k, v in c.items()})
    cache = model.new_cache()
    model(ids[:, :5], cache=cache)
    r["step"] = model(ids[:, 5:], cache=cache).logits
    r["keys"] = [layer.keys_values()[0] for layer in cache.layers]
    prompts = [ids[:1, :6], ids[1:, :7], ids[:1, 2:]]
    r["sweep"] = head_ablation_sweep(model, prompts,
                                     lambda o: o.logits[0, -1, 3] - o.logits[0, -1, 4])
    last = model.config.num_heads - 1  # a head of the last rank
    r["patched"] = run_with_hooks(model, ids, hooks=head_ablation_hooks(model, [(0, last)])).logits
    r["generated"] = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
    return r


saved = {}
for name, (options, vocab) in CASES.items():
    torch.manual_seed(0)
    cfg = hf.CausalLMConfig(**{**dict(vocab_size=30, max_len=32, d_model=32, num_layers=2,
                                      d_ff=44), **options})
    model = hf.CausalLM(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, 30, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    one = results(model, ids, mask)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    tp = parallelize(copy.deepcopy(model), mesh, vocab=vocab)
    mine = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in tp.parameters())
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if "norm" in n or n.split(".")[-2].startswith("ln"))
    saved[name] = {"one": one, "tp": results(tp, ids, mask), "whole": whole, "mine": mine,
                   "norms": norms,
                   "kv": tp.blocks[0].attn.k_proj.weight.shape[0] // cfg.head_dim}
    if name == "smollm2":  # hook points gather only when a hook listens
        calls = []
        gather = shards.dist.all_gather
        shards.dist.all_gather = lambda *a, **k: (calls.append(1), gather(*a, **k))[1]
        tp(ids)
        quiet = len(calls)
        run_with_hooks(tp, ids, hooks={"blocks.1.attn.hook_z": lambda t, n: None})
        shards.dist.all_gather = gather
        saved["gathers"] = (quiet, len(calls) - quiet)
    if name == "smollm2":  # no backward through the collectives: refused, by name
        try:
            attribution_patching(tp, [ids[:1]], [ids[1:]], lambda o: o.logits[0, -1, 3])
        except ValueError as e:
            saved["backward"] = str(e)
    if name == "smollm2":  # no torch.compile of the collectives in forward hooks
        try:
            tp.generate(ids[:1], max_new_tokens=2, compile=True)
        except ValueError as e:
            saved["compile"] = str(e)
    if name == "smollm2":  # a sharded model refuses a second parallelize
        try:
            parallelize(tp, mesh)
        except ValueError as e:
            saved["twice"] = str(e)

# load_lm(mesh=): a Hugging Face llama folder and a Q8_0 GGUF, each rank reading its slices
folder = out / "llama"
if rank == 0:
    torch.manual_seed(1)
    E, H, K, D, F, V = 32, 4, 2, 8, 48, 40
    state = {"model.embed_tokens.weight": torch.randn(V, E) * 0.3,
             "model.norm.weight": torch.rand(E) + 0.5,
             "lm_head.weight": torch.randn(V, E) * 0.3}
    for i in range(2):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": torch.randn(H * D, E) * 0.3,
                      p + "self_attn.k_proj.weight": torch.randn(K * D, E) * 0.3,
                      p + "self_attn.v_proj.weight": torch.randn(K * D, E) * 0.3,
                      p + "self_attn.o_proj.weight": torch.randn(E, H * D) * 0.3,
                      p + "mlp.gate_proj.weight": torch.randn(F, E) * 0.3,
                      p + "mlp.up_proj.weight": torch.randn(F, E) * 0.3,
                      p + "mlp.down_proj.weight": torch.randn(E, F) * 0.3,
                      p + "input_layernorm.weight": torch.rand(E) + 0.5,
                      p + "post_attention_layernorm.weight": torch.rand(E) + 0.5})
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=E, intermediate_size=F, num_attention_heads=H,
        num_key_value_heads=K, num_hidden_layers=2, vocab_size=V, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")))
    tiny_llama_gguf(out / "tiny.gguf")
    for r in range(2):  # each rank's own copy, as on separate machines
        shutil.copytree(folder, out / f"llama-{r}")
    damaged = out / "llama-1" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-64])
    # one file, damaged inside rank 1's slice only: a NaN scale in row 20 of blk.0.attn_q
    # (Q8_0: one 34-byte block per row of 32; rank 1 reads rows 16-31, heads 2 and 3)
    from handformer.pretrained.gguf import read_gguf
    info = read_gguf(out / "tiny.gguf").tensors["blk.0.attn_q.weight"]
    data = bytearray((out / "tiny.gguf").read_bytes())
    data[info.offset + 20 * 34:info.offset + 20 * 34 + 2] = b"\x00\x7e"  # float16 NaN
    (out / "nan.gguf").write_bytes(bytes(data))
dist.barrier()
torch.manual_seed(2)  # every rank the same inputs (rank 0 drew more numbers above)
ids = torch.randint(0, 16, (1, 8))
for source in (folder, out / "tiny.gguf"):
    one, _ = load_lm(source, tokenizer=False)
    tp, _ = load_lm(source, tokenizer=False, mesh=mesh)
    saved[source.name] = {"one": one(ids).logits, "tp": tp(ids).logits,
                          "generated": (one.generate(ids, max_new_tokens=4, do_sample=False),
                                        tp.generate(ids, max_new_tokens=4, do_sample=False)),
                          "whole": sum(p.numel() * 4 for p in one.parameters()),
                          "mine": sum(p.numel() * 4 for p in tp.parameters())}
try:
    load_lm(out / f"llama-{rank}", tokenizer=False, mesh=mesh)
except Exception as e:
    saved["damaged"] = f"{type(e).__name__}: {e}"
try:
    load_lm(out / "nan.gguf", tokenizer=False, mesh=mesh)
except Exception as e:
    saved["nan"] = f"{type(e).__name__}: {e}"
torch.save(saved, out / f"rank{rank}.pt")
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("tp")
    script = tmp / "tp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script),
         str(tmp), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _close(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, where
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=where)
    else:
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")


@pytest.mark.parametrize("case", ["gqa", "uneven", "smollm2"])
def test_every_result_equals_one_process(ranks: list[dict], case: str) -> None:
    for rank in ranks:
        one, tp = rank[case]["one"], rank[case]["tp"]
        cached = [k for k in one if k.startswith("cache.")]
        assert len(cached) > 30 and sorted(tp) == sorted(one)  # every hook point, same names
        for key in one:
            if key == "keys":
                continue
            if key == "generated":
                assert torch.equal(tp[key], one[key])
                continue
            _close(one[key], tp[key], f"{case} {key}")
        assert one["sweep"].abs().max() > 1e-3 and one["sweep"].shape[1] == \
            {"gqa": 4, "uneven": 5, "smollm2": 9}[case]
        assert (one["patched"] - one["logits"]).abs().max() > 1e-3  # the patch did something


def test_the_decoding_cache_holds_this_ranks_heads(ranks: list[dict]) -> None:
    # gqa: KV heads 0 | 1; uneven: heads 0-2 | 3-4; smollm2: heads 0-4 read KV heads
    # 0,0,0,1,1 and heads 5-8 read 1,2,2,2 (a group cut in two: one copy per query head)
    held = {"gqa": ([0], [1]), "uneven": ([0, 1, 2], [3, 4]),
            "smollm2": ([0, 0, 0, 1, 1], [1, 2, 2, 2])}
    for case, per_rank in held.items():
        for rank, heads in zip(ranks, per_rank, strict=True):
            assert rank[case]["kv"] == len(heads)
            for one, tp in zip(rank[case]["one"]["keys"], rank[case]["tp"]["keys"],
                               strict=True):
                _close(one[:, heads], tp, f"{case} cache")


def test_each_rank_holds_about_half_the_parameters(ranks: list[dict]) -> None:
    for case, rank in ((c, r) for c in ("gqa", "uneven", "smollm2", "llama", "tiny.gguf")
                       for r in ranks):
        whole, mine = rank[case]["whole"], rank[case]["mine"]
        # replicated: norms, biases of out/down on rank 0, the vocabulary unless sharded
        assert mine < 0.75 * whole, (case, mine, whole)
    # gqa: heads, KV heads, MLP and (tied) vocabulary split in halves; only the norms (and
    # QK-norms) are on both ranks: exactly half of the rest plus the norms
    for rank in ranks:
        whole, norms = rank["gqa"]["whole"], rank["gqa"]["norms"]
        assert rank["gqa"]["mine"] == (whole - norms) // 2 + norms


@pytest.mark.parametrize("source", ["llama", "tiny.gguf"])
def test_load_lm_with_a_mesh_reads_slices_equal_to_one_process(ranks: list[dict],
                                                                source: str) -> None:
    for rank in ranks:
        _close(rank[source]["one"], rank[source]["tp"], source)
        one, tp = rank[source]["generated"]
        assert torch.equal(one, tp)


def test_a_rank_that_cannot_load_stops_every_rank_with_one_line(ranks: list[dict]) -> None:
    for rank in ranks:  # rank 1's copy is truncated; both ranks raise the same line
        message = rank["damaged"]
        assert message.startswith("CheckpointError: rank 1 could not load its part of the "
                                  "model: CheckpointError: "), message
        assert "llama-1/model.safetensors" in message and "\n" not in message
    assert ranks[0]["damaged"] == ranks[1]["damaged"]
    for rank in ranks:  # a slice only rank 1 reads is damaged: both stop, naming rank 1
        assert rank["nan"].startswith("CheckpointError: rank 1 could not load its part of "
                                      "the model: CheckpointError: "), rank["nan"]
        assert "nan.gguf" in rank["nan"] and "blk.0.attn_q.weight" in rank["nan"]
    assert ranks[0]["nan"] == ranks[1]["nan"]
    assert "already sharded" in ranks[0]["twice"]
    assert ranks[0]["compile"].startswith("compile=True does not compile a tensor-parallel")
    assert ranks[0]["backward"].startswith("a tensor-parallel model runs forward passes only")


def test_hook_points_gather_only_when_a_hook_listens(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["gathers"] == (0, 1)  # none without hooks; one for one listening point


def test_quantized_projections_are_refused_by_name() -> None:
    class Int8Linear(nn.Module):  # what a quantized projection looks like: no float weight
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("weight", torch.zeros(16, 8, dtype=torch.int8))

    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=23, max_len=16, d_model=8, num_heads=2,
                                          num_layers=1, d_ff=16))
    model.blocks[0].mlp.linear1 = Int8Linear()
    mesh = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)  # no process group needed
    with pytest.raises(ValueError, match=r"blocks.0.mlp\.linear1 is a .*Int8Linear \(a "
                                         r"quantized model\?\): load it without quantize="):
        parallelize(model, mesh)


def test_the_plan_splits_whole_heads() -> None:
    assert split_evenly(9, 2) == [range(0, 5), range(5, 9)]
    assert split_evenly(1536, 2) == [range(0, 768), range(768, 1536)]
    assert [kv_heads_for(r, 8, 2) for r in split_evenly(8, 4)] == [[0], [0], [1], [1]]
    assert [kv_heads_for(r, 12, 4) for r in split_evenly(12, 2)] == [[0, 1], [2, 3]]
    assert [kv_heads_for(r, 9, 3) for r in split_evenly(9, 2)] == [[0, 0, 0, 1, 1],
                                                                  [1, 2, 2, 2]]
    assert [vocab_range(49152, 2, r) for r in (0, 1)] == [range(0, 24576), range(24576, 49152)]
    assert [len(vocab_range(30, 4, r)) for r in range(4)] == [8, 8, 8, 6]
