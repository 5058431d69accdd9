"""trl_trainers.ppo_math against plain NumPy references, on random inputs with masks and padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trl_trainers import ppo_math as pm

RNG = np.random.default_rng(0)


def _rand(b=5, t=7):
    return RNG.normal(size=(b, t)).astype(np.float64)


def _lengths(b=5, t=7):
    # include an empty response (-1) and a full one (t - 1)
    lengths = RNG.integers(-1, t, size=b)
    lengths[0], lengths[1] = t - 1, -1
    return lengths


def _t(x):
    return torch.tensor(x)


def np_first_true(bools):
    out = []
    for row in bools:
        idx = np.flatnonzero(row)
        out.append(idx[0] if len(idx) else row.shape[0])
    return np.array(out)


def np_masks(lengths, t):
    pos = np.arange(t)[None, :]
    return pos <= lengths[:, None], pos <= lengths[:, None] + 1


def np_masked_mean(x, m):
    return x[m].mean()


def np_masked_var(x, m, unbiased=True):
    v = x[m]
    return v.var(ddof=1 if unbiased else 0)


def np_whiten(x, m, shift_mean=True):
    mean, var = x[m].mean(), x[m].var(ddof=1)
    w = (x - mean) / np.sqrt(var + 1e-8)
    return w if shift_mean else w + mean


def np_gae(rewards, values, gamma, lam):
    b, t = rewards.shape
    adv = np.zeros_like(rewards)
    for i in range(b):
        last = 0.0
        for j in reversed(range(t)):
            nv = values[i, j + 1] if j + 1 < t else 0.0
            delta = rewards[i, j] + gamma * nv - values[i, j]
            last = delta + gamma * lam * last
            adv[i, j] = last
    return adv, adv + values


def test_first_true_and_truncate():
    tokens = RNG.integers(0, 5, size=(6, 9))
    np.testing.assert_array_equal(pm.first_true_indices(_t(tokens == 3)).numpy(), np_first_true(tokens == 3))
    truncated = pm.truncate_after_stop_token(_t(tokens), stop_token_id=3, pad_token_id=-1).numpy()
    for row, out in zip(tokens, truncated, strict=True):
        stop = np_first_true(row[None] == 3)[0]
        np.testing.assert_array_equal(out[: stop + 1], row[: stop + 1])
        assert (out[stop + 1 :] == -1).all()


def test_response_masks():
    lengths = _lengths()
    tok, val = pm.response_masks(_t(lengths), 7)
    ref_tok, ref_val = np_masks(lengths, 7)
    np.testing.assert_array_equal(tok.numpy(), ref_tok)
    np.testing.assert_array_equal(val.numpy(), ref_val)


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_mean_var_whiten(unbiased):
    x = _rand()
    mask, _ = np_masks(_lengths(), 7)
    np.testing.assert_allclose(pm.masked_mean(_t(x), _t(mask)).item(), np_masked_mean(x, mask), rtol=1e-12)
    np.testing.assert_allclose(pm.masked_var(_t(x), _t(mask), unbiased).item(), np_masked_var(x, mask, unbiased),
                               rtol=1e-12)
    for shift in (True, False):
        got = pm.masked_whiten(_t(x), _t(mask), shift_mean=shift).numpy()
        np.testing.assert_allclose(got[mask], np_whiten(x, mask, shift)[mask], rtol=1e-10)
    # per-dim mean
    rows = mask.any(1)
    got = pm.masked_mean(_t(x[rows]), _t(mask[rows]), dim=1).numpy()
    np.testing.assert_allclose(got, [x[i][mask[i]].mean() for i in np.flatnonzero(rows)], rtol=1e-12)


def test_whiten_split_over_shards_equals_whole():
    """Whitening with statistics summed over shards (as over ranks) equals whitening the concatenated batch."""
    x = _rand(8, 6)
    mask, _ = np_masks(RNG.integers(0, 6, size=8), 6)
    shards = [(_t(x[:3]), _t(mask[:3])), (_t(x[3:]), _t(mask[3:]))]

    def fake_all_reduce_for(k):
        # simulates dist.all_reduce(SUM): the other shard contributes its own partial sums
        other_x, other_m = shards[1 - k]

        def reduce(t):
            if t.numel() == 2:
                mf = other_m.double()
                return t + torch.stack([mf.sum(), (other_x * mf).sum()])
            mean = t  # second call: squared deviations; recompute the other shard's part with the global mean
            return mean + reduce.other_sq()

        return reduce

    whole = np_whiten(x, mask)
    for k, (xs, ms) in enumerate(shards):
        reduce = fake_all_reduce_for(k)
        ox, om = shards[1 - k]
        gmean = x[mask].mean()
        reduce.other_sq = lambda ox=ox, om=om, gmean=gmean: ((ox - gmean) ** 2 * om.double()).sum().reshape(1)
        got = pm.masked_whiten(xs, ms, all_reduce=reduce).numpy()
        part = whole[:3] if k == 0 else whole[3:]
        np.testing.assert_allclose(got[ms.numpy()], part[ms.numpy()], rtol=1e-10)


def test_logprobs_and_entropy():
    logits = RNG.normal(size=(3, 4, 11))
    tokens = RNG.integers(0, 11, size=(3, 4))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ref = np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(pm.logprobs_from_logits(_t(logits), _t(tokens)).numpy(), ref, rtol=1e-5)
    probs = np.exp(logp)
    np.testing.assert_allclose(pm.entropy_from_logits(_t(logits)).numpy(), -(probs * logp).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_and_reward_assembly(estimator):
    t = 7
    lengths = _lengths(5, t)
    tok_mask, _ = np_masks(lengths, t)
    logp, ref = _rand(5, t) * 0.3, _rand(5, t) * 0.3
    logp[~tok_mask] = pm.INVALID_LOGPROB
    ref[~tok_mask] = pm.INVALID_LOGPROB
    log_r = ref - logp
    kl_ref = -log_r if estimator == "k1" else np.exp(log_r) - 1 - log_r
    kl = pm.kl_per_token(_t(logp), _t(ref), estimator)
    np.testing.assert_allclose(kl.numpy(), kl_ref, rtol=1e-10, atol=1e-12)
    assert np.all(kl.numpy()[~tok_mask] == 0)  # padding carries no KL
    scores = RNG.normal(size=5)
    rewards, nsr = pm.kl_penalty_rewards(kl, _t(scores), _t(lengths), kl_coef=0.05)
    expected = -0.05 * kl_ref
    for i, length in enumerate(lengths):
        end = length + 1 if length + 1 < t else length
        expected[i, end] += scores[i]
    np.testing.assert_allclose(rewards.numpy(), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(nsr.numpy(), -0.05 * kl_ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="kl_estimator"):
        pm.kl_per_token(_t(logp), _t(ref), "k2")


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5)])
def test_gae(gamma, lam):
    lengths = _lengths(6, 8)
    _, val_mask = np_masks(lengths, 8)
    rewards, values = _rand(6, 8), _rand(6, 8)
    rewards[~val_mask], values[~val_mask] = 0.0, 0.0
    adv, ret = pm.compute_gae(_t(rewards), _t(values), gamma, lam)
    ref_adv, ref_ret = np_gae(rewards, values, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-10, atol=1e-12)


def test_policy_and_value_losses():
    lengths = _lengths(6, 8)
    tok_mask, val_mask = np_masks(lengths, 8)
    new, old, adv = _rand(6, 8) * 0.3, _rand(6, 8) * 0.3, _rand(6, 8)
    ratio = np.exp(new - old)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    loss, clipfrac, r = pm.policy_loss(_t(new), _t(old), _t(adv), _t(tok_mask), 0.2)
    np.testing.assert_allclose(loss.item(), np.maximum(l1, l2)[tok_mask].mean(), rtol=1e-10)
    np.testing.assert_allclose(clipfrac.item(), (l2 > l1)[tok_mask].mean(), rtol=1e-10)
    np.testing.assert_allclose(r.numpy(), ratio, rtol=1e-10)

    v, vold, ret = _rand(6, 8), _rand(6, 8), _rand(6, 8)
    vclip = np.clip(v, vold - 0.2, vold + 0.2)
    e1, e2 = (v - ret) ** 2, (vclip - ret) ** 2
    vloss, vfrac = pm.value_loss(_t(v), _t(vold), _t(ret), _t(val_mask), 0.2)
    np.testing.assert_allclose(vloss.item(), 0.5 * np.maximum(e1, e2)[val_mask].mean(), rtol=1e-10)
    np.testing.assert_allclose(vfrac.item(), (e2 > e1)[val_mask].mean(), rtol=1e-10)
    np.testing.assert_allclose(pm.approx_kl(_t(new), _t(old)).item(), 0.5 * ((new - old) ** 2).mean(), rtol=1e-10)


def test_policy_gradient_sign():
    """Raising the log-prob of a positive-advantage token lowers the loss (the gradient points the right way)."""
    new = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    loss, _, _ = pm.policy_loss(new, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1.0, -1.0]],
                                dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool), 0.2)
    loss.backward()
    assert new.grad[0, 0] < 0 < new.grad[0, 1]


def test_normalizer_makes_loss_split_invariant():
    """With the global token count as normalizer, summed micro-batch losses equal the whole-batch loss."""
    lengths = _lengths(6, 8)
    tok_mask, val_mask = np_masks(lengths, 8)
    new, old, adv = _t(_rand(6, 8) * 0.3), _t(_rand(6, 8) * 0.3), _t(_rand(6, 8))
    whole, _, _ = pm.policy_loss(new, old, adv, _t(tok_mask), 0.2)
    n = float(tok_mask.sum())
    parts = sum(pm.policy_loss(new[s], old[s], adv[s], _t(tok_mask[s]), 0.2, normalizer=n)[0]
                for s in (slice(0, 2), slice(2, 6)))
    np.testing.assert_allclose(parts.item(), whole.item(), rtol=1e-10)
    v, vold, ret = _t(_rand(6, 8)), _t(_rand(6, 8)), _t(_rand(6, 8))
    whole_v, _ = pm.value_loss(v, vold, ret, _t(val_mask), 0.2)
    nv = float(val_mask.sum())
    parts_v = sum(pm.value_loss(v[s], vold[s], ret[s], _t(val_mask[s]), 0.2, normalizer=nv)[0]
                  for s in (slice(0, 3), slice(3, 6)))
    np.testing.assert_allclose(parts_v.item(), whole_v.item(), rtol=1e-10)
