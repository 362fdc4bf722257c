"""Skip transcoders and massive activations in training and evaluation
(handformer.features.objective, train, stream, metrics): the skip term's loss and gradients
against a dense float64 computation, its folding into raw units, its gain over latents alone, and
the rows with massive activations left out of training and of
``explained_variance_typical``."""

from __future__ import annotations

import pytest
import torch

import handformer as hf
from handformer.features import SparseAutoencoder, Transcoder
from handformer.features.metrics import MASSIVE, evaluate_dictionary
from handformer.features.objective import DictionarySet, TrainingDictionary, site_key
from handformer.features.stream import Site, typical_mask, typical_rows
from handformer.features.train import SAETrainConfig, export, train_dictionary
from handformer.inspect import run_with_cache

E, F_OUT, S = 12, 10, 30


def skip_dictionary(seed: int = 0) -> TrainingDictionary:
    g = torch.Generator().manual_seed(seed)
    return TrainingDictionary(E, S, F_OUT, kind="topk", k=4, transcoder=True, generator=g,
                              skip=True)


def test_skip_loss_and_gradients_equal_the_dense_float64_computation() -> None:
    """``y_hat = TopK(x W_enc + b_enc) W_dec + b_dec + x W_skip`` in scaled units; dropping the
    skip term from either training path fails here."""
    td = skip_dictionary().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, E, generator=g, dtype=torch.float64)
    y = torch.randn(48, F_OUT, generator=g, dtype=torch.float64)
    with torch.no_grad():
        td.W_skip.copy_(torch.randn(E, F_OUT, generator=g, dtype=torch.float64))
        td.b_enc.copy_(0.1 * torch.randn(S, generator=g, dtype=torch.float64))
        td.scale_in.fill_(1.3)
        td.scale_out.fill_(0.7)
        td.variance.fill_(2.0)
    loss, _ = td.losses(x, y, dead_after=10**9, k_aux=8, aux_coeff=0.0, l1_coeff=0.0)
    loss.backward()
    got = {n: p.grad.clone() for n, p in td.named_parameters()}

    p = {n: q.detach().clone().requires_grad_(True) for n, q in td.named_parameters()}
    xs, ys = 1.3 * x, 0.7 * y
    pre = xs @ p["W_enc"] + p["b_enc"]  # (N, S)
    values, index = pre.topk(4, dim=-1)
    z = torch.zeros_like(pre).scatter(-1, index, torch.relu(values))
    y_hat = z @ p["W_dec"] + p["b_dec"] + xs @ p["W_skip"]
    ref = (ys - y_hat).pow(2).sum(-1).mean() / 2.0
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-12
    for name, q in p.items():
        torch.testing.assert_close(got[name], q.grad, rtol=0, atol=1e-12, msg=name)


def test_a_skip_transcoder_folds_into_raw_units() -> None:
    td = skip_dictionary()
    g = torch.Generator().manual_seed(3)
    x = 40 * torch.randn(64, E, generator=g) + 3
    y = 0.02 * torch.randn(64, F_OUT, generator=g)
    td.initialise(x, y)
    with torch.no_grad():
        td.W_skip.add_(torch.randn(E, F_OUT, generator=g))  # not only its initial value
    at = "blocks.0.hook_mlp_out"
    dset = DictionarySet({"kind": "topk", "k": 4, "d_sae": S, "transcoder": True,
                          "skip": True}, {at: (E, F_OUT)}, g)
    dset.dicts[site_key(at)].load_state_dict(td.state_dict())
    d = export(dset, [Site(at, True, 0)])[at]
    assert isinstance(d, Transcoder) and d.W_skip is not None
    with torch.no_grad():
        xs = x * td.scale_in
        z = td.activate(td.pre_acts(xs))
        want = (td.decode(z) + td.skip(xs)) / td.scale_out
    torch.testing.assert_close(d(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def tiny_lm(seed: int = 0) -> hf.CausalLM:
    torch.manual_seed(seed)
    return hf.CausalLM(hf.CausalLMConfig(vocab_size=50, max_len=64, d_model=32, num_heads=2,
                                         num_layers=2, d_ff=64, norm="rms", mlp="gated",
                                         positional="rotary")).eval()


def test_skip_transcoders_explain_more_of_an_mlp_than_latents_alone() -> None:
    """With one latent per token, a transcoder cannot follow a dense MLP map; the skip term
    takes its linear part (explained variance measured by evaluate_dictionary)."""
    lm = tiny_lm()
    ids = torch.randint(0, 50, (6000,), generator=torch.Generator().manual_seed(0))
    held = torch.randint(0, 50, (8, 32), generator=torch.Generator().manual_seed(9))
    ev = {}
    for skip in (False, True):
        r = train_dictionary(lm, ids, at="blocks.1.hook_mlp_out", transcoder=True, skip=skip,
                             d_sae=32, k=1, tokens=3000, context=32, batch=4, lr=3e-3,
                             progress=False)
        d = r.dictionaries["blocks.1.hook_mlp_out"]
        assert (d.W_skip is not None) == skip
        ev[skip] = evaluate_dictionary(lm, d, held, at="blocks.1.hook_mlp_out").explained_variance
    assert ev[True] >= ev[False] + 0.1, ev


def test_typical_mask_leaves_out_rows_over_the_factor_times_the_median_norm() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(101, 6, generator=g)
    y = torch.randn(101, 5, generator=g)
    x[7] *= 500  # a massive input
    y[40] *= 500  # a massive target
    keep = typical_mask(x, y, 10.0)
    xn, yn = x.norm(dim=-1), y.norm(dim=-1)
    want = [bool(xn[i] <= 10 * xn.median() and yn[i] <= 10 * yn.median()) for i in range(101)]
    assert keep.tolist() == want and not keep[7] and not keep[40] and int(keep.sum()) == 99
    assert bool(typical_mask(x, y, 0).all())  # 0: every row
    xk, yk = typical_rows(x, y, 10.0)
    assert torch.equal(xk, x[keep]) and torch.equal(yk, y[keep])
    x2, y2 = torch.randn(5, 3), torch.randn(5, 3)
    assert typical_rows(x2, y2, 10.0)[0] is x2  # nothing to leave out: no copy


@torch.no_grad()
def test_explained_variance_typical_leaves_out_the_massive_rows() -> None:
    """A token whose embedding is 1,000 times the others' gives massive rows; the typical
    explained variance is the float64 one over the rest (per batch, as the training drops
    them), and the plain one keeps every row."""
    lm = tiny_lm()
    lm.tok_emb.weight[7] *= 1000.0
    at = "blocks.0.hook_resid_pre"
    torch.manual_seed(5)
    sae = SparseAutoencoder(32, 40, activation="relu", hook_name=at)
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(6))
    ids[ids == 7] = 8
    ids[0, 5] = ids[2, 9] = 7
    m = evaluate_dictionary(lm, sae, ids, at=at, batch=4)

    _, cache = run_with_cache(lm, ids, names=at)
    y = cache[at][:, 1:].double().reshape(-1, 32)  # (N, E), positions 1..
    z = torch.relu((y - sae.b_dec.double()) @ sae.W_enc.double() + sae.b_enc.double())
    y_hat = z @ sae.W_dec.double() + sae.b_dec.double()
    norm = y.norm(dim=-1)
    keep = norm <= MASSIVE * norm.median()
    assert int((~keep).sum()) == 2

    def ev(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(1 - ((a - b) ** 2).sum() / ((a - a.mean(0)) ** 2).sum())

    assert abs(m.explained_variance - ev(y, y_hat)) < 1e-5
    assert abs(m.explained_variance_typical - ev(y[keep], y_hat[keep])) < 1e-5
    assert abs(m.massive_fraction - 2 / y.shape[0]) < 1e-12
    assert abs(m.explained_variance_typical - m.explained_variance) > 1e-3  # they differ


@pytest.mark.parametrize("options, message", [
    (dict(skip=True), "skip=True is a transcoder's option"),
    (dict(massive=0.5), "massive must be 0"),
    (dict(massive=True), "massive must be 0"),
])
def test_the_options_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SAETrainConfig(at="blocks.0.hook_resid_post", **options).validate()
    with pytest.raises(ValueError, match="skip=True is a transcoder's option"):
        TrainingDictionary(4, 8, 4, kind="topk", k=2, transcoder=False,
                           generator=torch.Generator(), skip=True)
