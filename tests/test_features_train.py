"""Training dictionaries (handformer.features.train, objective): planted sparse directions are
recovered, AuxK revives dead latents, the decoder stays at unit norm, the saved weights read raw
activations, and a stopped run resumes bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

import handformer as hf
from handformer.features import SparseAutoencoder, load_dictionary
from handformer.features.objective import (
    TrainingDictionary,
    geometric_median,
    normalise_decoder,
    project_decoder_grad,
)
from handformer.features.train import train_dictionary, train_on_activations

E, NF, K = 16, 24, 3


def planted(seed: int = 0) -> torch.Tensor:
    """``NF`` random unit directions in ``E`` dims."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(NF, E, generator=g)
    return dirs / dirs.norm(dim=-1, keepdim=True)


def sparse_data(dirs: torch.Tensor, k: int, offset: float = 0.5, rows: int = 512):
    """``data(step)``: each row is ``k`` of the directions with weights in [1, 2], plus a
    constant offset (what ``b_dec`` must learn)."""
    def data(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        idx = torch.rand(rows, dirs.shape[0], generator=g).argsort(-1)[:, :k]
        a = torch.zeros(rows, dirs.shape[0]).scatter(-1, idx, 1 + torch.rand(rows, k,
                                                                               generator=g))
        return a @ dirs + offset
    return data


def test_a_topk_sae_recovers_planted_sparse_directions() -> None:
    dirs = planted()
    data = sparse_data(dirs, K)
    result = train_on_activations(data, d_sae=48, k=K, rows=512, tokens=512 * 400, lr=1e-2,
                                  progress=False)
    sae = result.dictionaries["activations"]
    W = sae.W_dec.detach()
    cosine = (dirs @ (W / W.norm(dim=-1, keepdim=True)).T).max(-1).values  # (NF,)
    assert cosine.min() >= 0.9, cosine  # every planted direction has a latent (0.986 seen)
    x = data(10_000)  # held out
    with torch.no_grad():
        ev = 1 - float(((x - sae(x)) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
    assert ev >= 0.9, ev  # 0.96 seen
    assert float((sae.encode(x) > 0).sum(-1).float().mean()) <= K


def test_auxk_revives_dead_latents() -> None:
    """Data in a 12-dim subspace of 128 dims, more features than latents: half the random
    latents point away from the data and die; AuxK's gradient (the dead latents'
    reconstruction of the error) turns them towards it."""
    E2, SUB, NF2 = 128, 12, 128
    g = torch.Generator().manual_seed(0)
    dirs = torch.randn(NF2, SUB, generator=g)
    dirs = torch.cat([dirs / dirs.norm(dim=-1, keepdim=True), torch.zeros(NF2, E2 - SUB)], 1)
    data = sparse_data(dirs, 2, offset=0.0, rows=256)
    dead = {}
    for aux in (1 / 32, 0.0):
        r = train_on_activations(data, d_sae=64, k=2, rows=256, tokens=256 * 200, lr=1e-2,
                                 progress=False, aux_coeff=aux, dead_after=256 * 20)
        dead[aux] = r.history[-1]["dead"]
    assert dead[0.0] >= 0.15, dead  # without AuxK a fifth stay dead (0.20 seen)
    assert dead[1 / 32] <= dead[0.0] / 3, dead  # with it few do (0.016 seen)


def test_decoder_rows_keep_unit_norm_and_the_gradient_loses_its_radial_part() -> None:
    g = torch.Generator().manual_seed(0)
    td = TrainingDictionary(8, 12, 8, kind="topk", k=2, transcoder=False, generator=g)
    x = torch.randn(64, 8, generator=g)
    td.initialise(x, x)
    loss, _ = td.losses(x, x, dead_after=10**9, k_aux=4, aux_coeff=0.0, l1_coeff=0.0)
    loss.backward()
    project_decoder_grad(td.W_dec)
    radial = (td.W_dec.grad * td.W_dec).sum(-1)  # (S,)
    assert radial.abs().max() < 1e-6
    with torch.no_grad():
        td.W_dec.add_(0.3 * torch.randn(12, 8, generator=g))
    normalise_decoder(td.W_dec)
    torch.testing.assert_close(td.W_dec.norm(dim=-1), torch.ones(12))
    # and through a whole run
    r = train_on_activations(sparse_data(planted(), K), d_sae=32, k=K, rows=128,
                             tokens=128 * 20, progress=False)
    norms = r.dictionaries["activations"].W_dec.norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))


def test_geometric_median_against_float64_weiszfeld_and_outliers() -> None:
    x = torch.cat([torch.randn(200, 3, generator=torch.Generator().manual_seed(1)),
                   torch.full((20, 3), 1000.0)])
    m = geometric_median(x, iterations=200)
    assert m.norm() < 1.0  # the mean is ~ 91 away; the median ignores the outliers
    # the median minimises the sum of distances: no nearby point does better
    cost = lambda p: float((x.double() - p.double()).norm(dim=-1).sum())  # noqa: E731
    for d in torch.eye(3):
        assert cost(m) <= cost(m + 1e-2 * d) and cost(m) <= cost(m - 1e-2 * d)


@pytest.mark.parametrize("transcoder", [False, True])
def test_saved_weights_read_raw_activations(transcoder: bool) -> None:
    """Training runs in scaled units; the exported dictionary folds the scales back in, so it
    computes on raw activations exactly what the training dictionary computed on scaled ones."""
    g = torch.Generator().manual_seed(0)
    td = TrainingDictionary(8, 12, 6 if transcoder else 8, kind="topk", k=3,
                            transcoder=transcoder, generator=g)
    x = 40 * torch.randn(32, 8, generator=g) + 7
    y = 0.01 * torch.randn(32, 6, generator=g) if transcoder else x
    td.initialise(x, y)
    with torch.no_grad():
        td.b_enc.copy_(torch.randn(12, generator=g))
    assert abs(float(td.scale_in) - 1.0) > 0.5  # a real rescaling to fold
    from handformer.features import Transcoder
    from handformer.features.objective import DictionarySet, site_key
    from handformer.features.stream import Site
    from handformer.features.train import export

    dset = DictionarySet({"kind": "topk", "k": 3, "d_sae": 12, "transcoder": transcoder},
                         {"blocks.0.hook_mlp_out": (8, y.shape[1])}, g)
    dset.dicts[site_key("blocks.0.hook_mlp_out")].load_state_dict(td.state_dict())
    d = export(dset, [Site("blocks.0.hook_mlp_out", transcoder, 0)])["blocks.0.hook_mlp_out"]
    assert isinstance(d, Transcoder) == transcoder
    with torch.no_grad():
        z = td.activate(td.pre_acts(x * td.scale_in))
        expected = td.decode(z) / td.scale_out
    torch.testing.assert_close(d(x), expected, rtol=1e-5, atol=1e-5 * float(y.abs().max()))
    torch.testing.assert_close(d.encode(x), z / td.scale_in, rtol=1e-5, atol=1e-6)


def tiny_lm(seed: int = 0) -> hf.CausalLM:
    torch.manual_seed(seed)
    return hf.CausalLM(hf.CausalLMConfig(vocab_size=50, max_len=64, d_model=32, num_heads=2,
                                         num_layers=3, d_ff=64, norm="rms", mlp="gated",
                                         positional="rotary")).eval()


def test_a_stopped_run_resumes_bit_for_bit(tmp_path) -> None:
    lm = tiny_lm()
    ids = torch.randint(0, 50, (5000,), generator=torch.Generator().manual_seed(0))
    opts = dict(at=["blocks.0.hook_resid_post", "blocks.2.hook_resid_post"], d_sae=48, k=4,
                tokens=24 * 31 * 4, context=32, batch=4, progress=False, checkpoint_every=7,
                dead_after=200)
    whole = train_dictionary(lm, ids, out=tmp_path / "whole", **opts)
    part = train_dictionary(lm, ids, out=tmp_path / "part", stop_after=10, **opts)
    assert part.step == 10 and not part.finished
    rest = train_dictionary(lm, ids, out=tmp_path / "part", resume=True, **opts)
    assert rest.finished and rest.step == whole.step == 24
    for at, d in whole.dictionaries.items():
        for name, p in d.state_dict().items():
            assert torch.equal(p, rest.dictionaries[at].state_dict()[name]), (at, name)
    lines = lambda run: [json.loads(x) for x in  # noqa: E731
                         (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert lines("whole") == lines("part")  # the losses too, step by step
    saved = load_dictionary(tmp_path / "part" / "dictionaries" / "blocks.2.hook_resid_post")
    assert isinstance(saved, SparseAutoencoder) and saved.hook_name == "blocks.2.hook_resid_post"
    torch.testing.assert_close(saved.W_dec, rest.dictionaries["blocks.2.hook_resid_post"].W_dec)


def test_resume_refuses_a_folder_that_is_not_a_run_and_a_run_folder_twice(tmp_path) -> None:
    lm = tiny_lm()
    ids = torch.randint(0, 50, (2000,))
    with pytest.raises(ValueError, match="not a train-sae run folder"):
        train_dictionary(lm, ids, at="blocks.0.hook_resid_post", d_sae=16, k=2, tokens=100,
                         out=tmp_path, resume=True)
    train_dictionary(lm, ids, at="blocks.0.hook_resid_post", d_sae=16, k=2, tokens=100,
                     context=16, out=tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="already holds a train-sae run"):
        train_dictionary(lm, ids, at="blocks.0.hook_resid_post", d_sae=16, k=2, tokens=100,
                         out=tmp_path / "run")
    with pytest.raises(ValueError, match="k must be an integer in \\[1, d_sae=16\\]"):
        train_dictionary(lm, ids, at="blocks.0.hook_resid_post", d_sae=16, k=17, tokens=100)
    with pytest.raises(ValueError, match="JumpReLU dictionaries are loaded, not trained"):
        train_dictionary(lm, ids, at="blocks.0.hook_resid_post", kind="jumprelu", d_sae=16,
                         tokens=100)


def test_all_layers_transcoders_train_from_one_forward_per_step() -> None:
    lm = tiny_lm()
    ids = torch.randint(0, 50, (4000,))
    calls = []
    handle = lm.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        r = train_dictionary(lm, ids, at="all", transcoder=True, d_sae=32, k=4, tokens=600,
                             context=16, batch=4, progress=False, lr=3e-3)
    finally:
        handle.remove()
    assert sorted(r.dictionaries) == [f"blocks.{i}.hook_mlp_out" for i in range(3)]
    assert len(calls) == r.step + 1  # one forward per step (+ the first batch, for the init)
    for i, d in enumerate(r.dictionaries.values()):
        assert d.hook_name == f"blocks.{i}.mlp.hook_in"
        assert d.output_hook_name == f"blocks.{i}.hook_mlp_out"


@pytest.mark.parametrize("transcoder", [False, True])
def test_topk_loss_and_gradients_equal_the_dense_float64_computation(transcoder: bool) -> None:
    """The training step's TopK decoder (``embedding_bag`` over the chosen rows of ``W_dec``)
    gives the dense formula's loss and every gradient. Decoding from ``values`` without the
    ReLU (a negative k-th pre-activation) or adding ``b_dec`` twice fails here."""
    g = torch.Generator().manual_seed(3)
    td = TrainingDictionary(E, 40, E + 2 if transcoder else E, kind="topk", k=5,
                            transcoder=transcoder, generator=g).double()
    x = torch.randn(64, E, generator=g, dtype=torch.float64)
    y = torch.randn(64, E + 2, generator=g, dtype=torch.float64) if transcoder else x
    with torch.no_grad():
        td.b_enc.copy_(torch.randn(40, generator=g, dtype=torch.float64) * 0.1)
        td.b_dec.copy_(torch.randn(td.b_dec.shape, generator=g, dtype=torch.float64) * 0.1)
        td.scale_in.fill_(1.3)
        td.scale_out.fill_(0.7)
        td.variance.fill_(2.0)
    loss, parts = td.losses(x, y, dead_after=10**9, k_aux=8, aux_coeff=0.0, l1_coeff=0.0)
    loss.backward()
    sparse = {n: p.grad.clone() for n, p in td.named_parameters()}

    # the dense reference, written out: pre, TopK through a ReLU, decode, normalised MSE
    params = {n: p.detach().clone().requires_grad_(True) for n, p in td.named_parameters()}
    xs, ys = x * 1.3, y * 0.7
    inp = xs if transcoder else xs - params["b_dec"]
    pre = inp @ params["W_enc"] + params["b_enc"]  # (N, S)
    values, index = pre.topk(5, dim=-1)
    z = torch.zeros_like(pre).scatter(-1, index, torch.relu(values))
    y_hat = z @ params["W_dec"] + params["b_dec"]
    ref = (ys - y_hat).pow(2).sum(-1).mean() / 2.0
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-12
    assert float(parts["l0"]) == float((z > 0).double().sum(-1).mean())
    assert torch.equal(parts["fired"], (z > 0).any(0))
    for name, p in params.items():
        torch.testing.assert_close(sparse[name], p.grad, rtol=0, atol=1e-12, msg=name)
