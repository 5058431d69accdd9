"""Meta-gradients of `MetaLearner` against references: finite differences (second order), the FOMAML formula
(first order), the per-task loop (vmap), padding invariance, and the errors for settings that cannot work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gmeta_trainer import DLRMConfig, DLRMModel, InnerLoopConfig, InnerLoopError, MetaLearner, masked_task_loss


def _batch(T=3, ks=4, kq=3, vocab=(5, 3), nd=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.stack([torch.randint(0, v, (T, k), generator=g) for v in vocab], -1)

    return {"sup_sparse": ids(ks), "qry_sparse": ids(kq),
            "sup_dense": torch.randn(T, ks, nd, generator=g, dtype=dtype),
            "qry_dense": torch.randn(T, kq, nd, generator=g, dtype=dtype),
            "sup_y": torch.randint(0, 2, (T, ks), generator=g).to(dtype),
            "qry_y": torch.randint(0, 2, (T, kq), generator=g).to(dtype),
            "sup_w": torch.ones(T, ks, dtype=dtype), "qry_w": torch.ones(T, kq, dtype=dtype)}


def _tiny(seed=0, interaction="dot"):
    torch.manual_seed(seed)
    cfg = DLRMConfig(vocab_sizes=[5, 3], num_dense=2, embedding_dim=3, bottom_mlp=[4], top_mlp=[4],
                     interaction=interaction, init_std=0.5, seed=seed)
    return DLRMModel(cfg).double()


def _flat_grad(learner):
    return torch.cat([p.grad.flatten() for p in learner.parameters()])


@pytest.mark.parametrize("inner_params", ["dense", "all"])
def test_second_order_meta_gradient_matches_finite_differences(inner_params):
    learner = MetaLearner(_tiny(), InnerLoopConfig(inner_lr=0.4, inner_steps=2, inner_params=inner_params))
    batch = _batch()
    learner(**batch)["loss"].backward()
    analytic = _flat_grad(learner)
    # central differences along random directions (checks every component at once) and on random coordinates
    params = list(learner.parameters())
    gen = torch.Generator().manual_seed(1)
    directions = [torch.randn(analytic.numel(), generator=gen, dtype=torch.float64) for _ in range(3)]
    for i in torch.randperm(analytic.numel(), generator=gen)[:8].tolist():
        e = torch.zeros(analytic.numel(), dtype=torch.float64)
        e[i] = 1.0
        directions.append(e)
    eps = 1e-6

    def loss_at(offset):
        with torch.no_grad():
            start = 0
            for p in params:
                p.add_(offset[start:start + p.numel()].view_as(p))
                start += p.numel()
            value = learner(**batch)["loss"].item()
            start = 0
            for p in params:
                p.sub_(offset[start:start + p.numel()].view_as(p))
                start += p.numel()
        return value

    numeric = torch.tensor([(loss_at(eps * v) - loss_at(-eps * v)) / (2 * eps) for v in directions],
                           dtype=torch.float64)
    analytic = torch.stack([analytic @ v for v in directions])
    torch.testing.assert_close(analytic, numeric, rtol=1e-5, atol=1e-7)


def test_first_order_is_fomaml_and_differs_from_second_order():
    batch = _batch()
    so = MetaLearner(_tiny(), InnerLoopConfig(inner_lr=0.4, inner_steps=1))
    so(**batch)["loss"].backward()
    fo = MetaLearner(_tiny(), InnerLoopConfig(inner_lr=0.4, inner_steps=1, first_order=True))
    fo(**batch)["loss"].backward()
    # FOMAML reference by hand: per task, one SGD step on the support loss, gradient of the query loss at the
    # adapted weights, applied to the initial weights; averaged over tasks.
    model = _tiny()
    names = fo.fast_names
    ref = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    T = batch["sup_y"].shape[0]
    for t in range(T):
        m = _tiny()
        sup = masked_task_loss(m(batch["sup_sparse"][t], batch["sup_dense"][t]), batch["sup_y"][t],
                               batch["sup_w"][t])
        grads = torch.autograd.grad(sup, [dict(m.named_parameters())[n] for n in names])
        with torch.no_grad():
            for n, g in zip(names, grads):
                dict(m.named_parameters())[n].sub_(0.4 * g)
        qry = masked_task_loss(m(batch["qry_sparse"][t], batch["qry_dense"][t]), batch["qry_y"][t],
                               batch["qry_w"][t])
        qry.backward()
        for n, p in m.named_parameters():
            ref[n] += p.grad / T
    for n, p in fo.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-9, atol=1e-12)
    # regression test against the MeLU graph cut: second order must see the inner gradient's dependence
    assert (_flat_grad(so) - _flat_grad(fo)).abs().max() > 1e-6


@pytest.mark.parametrize("first_order", [False, True])
@pytest.mark.parametrize("inner_params", ["dense", "all", r"^top\."])
def test_vmap_equals_per_task_loop(first_order, inner_params):
    batch = _batch(T=4)
    grads = []
    for vmap in (True, False):
        learner = MetaLearner(_tiny(), InnerLoopConfig(inner_lr=0.3, inner_steps=2, first_order=first_order,
                                                       inner_params=inner_params, task_vmap=vmap))
        out = learner(**batch)
        out["loss"].backward()
        grads.append((out["logits"].detach(), _flat_grad(learner)))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-9, atol=1e-12)


def test_padding_with_zero_weights_does_not_change_loss_or_grads():
    batch = _batch(T=2, ks=4)
    padded = dict(batch)
    extra = 3
    padded["sup_sparse"] = torch.cat([batch["sup_sparse"], torch.zeros(2, extra, 2, dtype=torch.long)], 1)
    padded["sup_dense"] = torch.cat([batch["sup_dense"], torch.randn(2, extra, 2, dtype=torch.float64)], 1)
    padded["sup_y"] = torch.cat([batch["sup_y"], torch.ones(2, extra, dtype=torch.float64)], 1)
    padded["sup_w"] = torch.cat([batch["sup_w"], torch.zeros(2, extra, dtype=torch.float64)], 1)
    a = MetaLearner(_tiny(), InnerLoopConfig(inner_lr=0.3, inner_steps=2))
    b = MetaLearner(_tiny(), InnerLoopConfig(inner_lr=0.3, inner_steps=2))
    la, lb = a(**batch)["loss"], b(**padded)["loss"]
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(_flat_grad(a), _flat_grad(b))


def test_learnable_inner_rates_get_meta_gradients_and_eval_adapts():
    learner = MetaLearner(_tiny(), InnerLoopConfig(inner_lr=0.3, inner_steps=1, learn_inner_lr=True))
    assert set(learner.inner_lrs.keys()) == {n.replace(".", "__") for n in learner.fast_names}
    batch = _batch()
    learner(**batch)["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in learner.inner_lrs.values())
    # evaluation adapts (logits differ from the unadapted model) and leaves the parameters untouched
    before = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    learner.eval()
    with torch.no_grad():
        adapted = learner(**batch)["logits"]
    plain = learner.model(batch["qry_sparse"].flatten(0, 1), batch["qry_dense"].flatten(0, 1)).view_as(adapted)
    assert (adapted - plain).abs().max() > 1e-4
    for k, v in learner.state_dict().items():
        assert torch.equal(v, before[k]), k


class _OnceDifferentiableReLU(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clamp_min(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0)


class _OnceDiffModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.fc1 = nn.Linear(5, 4)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, sparse, dense):
        x = torch.cat([self.emb(sparse[..., 0]), dense], -1)
        return self.fc2(_OnceDifferentiableReLU.apply(self.fc1(x))).squeeze(-1)


def test_second_order_through_once_differentiable_layer_is_an_error_first_order_works():
    batch = _batch(vocab=(5,), dtype=torch.float32)
    with pytest.raises(InnerLoopError, match="twice differentiable.*first_order=True"):
        MetaLearner(_OnceDiffModel(), InnerLoopConfig(inner_lr=0.1))(**batch)
    out = MetaLearner(_OnceDiffModel(), InnerLoopConfig(inner_lr=0.1, first_order=True))(**batch)
    out["loss"].backward()


def test_bad_inner_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="inner_steps=0"):
        InnerLoopConfig(inner_steps=0)
    with pytest.raises(ValueError, match="inner_lr"):
        InnerLoopConfig(inner_lr=0.0)
    with pytest.raises(ValueError, match="regular"):
        InnerLoopConfig(inner_params="top[")
    with pytest.raises(InnerLoopError, match="selects no trainable parameter"):
        MetaLearner(_tiny(), InnerLoopConfig(inner_params="no_such_layer"))
    model = _tiny()
    model.top[0].weight.requires_grad_(False)
    with pytest.raises(InnerLoopError, match="frozen"):
        MetaLearner(model, InnerLoopConfig(inner_params=r"top\.0"))


def test_embedding_id_out_of_range_names_the_field():
    batch = _batch()
    batch["qry_sparse"][0, 0, 1] = 7  # field 1 has 3 rows
    for params in ("dense", "all"):
        with pytest.raises(ValueError, match=r"id 7 of sparse field 'field1' is out of range \[0, 3\)"):
            MetaLearner(_tiny(), InnerLoopConfig(inner_params=params))(**batch)
