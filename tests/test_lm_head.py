"""The chunked head against a dense full-vocabulary computation (plain autograd); the
sparse backward against the dense one, against a padded [N, K_max] layout, with the real
loss, and run twice (bit-identical)."""

import numpy as np
import pytest
import torch

import data as D
from run import evidence as E
import kernels
import loss as L
import data
from config import Config
from data import TokenSupport
from kernels import head
from loss import sparse_ok


def _support(N, V, gen, replayed_rows):
    ids, offs, logq, rep = [], [0], [], []
    for t in range(N):
        k = int(torch.randint(0, 6, (1,), generator=gen))  # some rows empty
        row = torch.randperm(V, generator=gen)[:k].tolist()
        ids += row
        logq += (torch.rand(k, generator=gen) * -3).tolist()
        offs.append(offs[-1] + k)
        rep.append(t in replayed_rows and k > 0)
    host = np.array(offs, dtype=np.int64)
    return TokenSupport(torch.tensor(ids, dtype=torch.int32), torch.from_numpy(host.copy()),
                        torch.tensor(logq), torch.tensor(rep), host)


def _dense(hidden, weight, labels, support, T):
    logits = (hidden @ weight.T).double() / T
    logp_all = logits.log_softmax(-1)
    logp, slp = [], []
    for t in range(hidden.shape[0]):
        a, b = int(support.host_offsets[t]), int(support.host_offsets[t + 1])
        row = support.ids[a:b].long()
        if support.replayed[t]:
            norm = torch.logsumexp(logits[t, row], 0)
            logp.append(logits[t, labels[t]] - norm)
            slp.append(logits[t, row] - norm)
        else:
            logp.append(logp_all[t, labels[t]])
            slp.append(logp_all[t, row])
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.stack(logp), ent, torch.cat(slp)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("chunk", [None, 3])
def test_head_matches_dense(chunk, keep, monkeypatch):
    monkeypatch.setattr(kernels, "KEEP_ELEMENTS", 1 << 20 if keep else 0)  # the kept logits, or recomputed
    gen = torch.Generator().manual_seed(0)
    N, H, V, T = 11, 8, 19, 0.7
    hidden = torch.randn(N, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (N,), generator=gen)
    support = _support(N, V, gen, replayed_rows={1, 2, 5, 8})
    for t in range(N):  # a replayed row holds its label
        a, b = int(support.host_offsets[t]), int(support.host_offsets[t + 1])
        if support.replayed[t]:
            labels[t] = support.ids[a]
    logp, ent, slp = head(hidden, weight, labels, support, T, chunk=chunk)
    ref_logp, ref_ent, ref_slp = _dense(hidden, weight, labels, support, T)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(slp.double(), ref_slp, atol=1e-5, rtol=0)
    assert not ent.requires_grad
    cl, cs = torch.randn(N, generator=gen, dtype=torch.float64), torch.randn(slp.shape[0], generator=gen, dtype=torch.float64)
    gh, gw = torch.autograd.grad((logp.double() * cl).sum() + (slp.double() * cs).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_logp * cl).sum() + (ref_slp * cs).sum(), (hidden, weight))
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=0)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=0)


def test_head_without_support():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(7, 4, generator=gen), torch.randn(13, 4, generator=gen)
    labels = torch.randint(0, 13, (7,), generator=gen)
    logp, ent, slp = head(hidden, weight, labels, None, 1.0, chunk=2)
    ref = (hidden @ weight.T).log_softmax(-1).gather(1, labels[:, None])[:, 0]
    torch.testing.assert_close(logp, ref, atol=1e-6, rtol=0)
    assert slp.shape == (0,)


# ----------------------------------------------------------------------------- the sparse backward

def _rows_support(kinds, labels, V, gen, k=4, pool=6):
    """A TokenSupport with one row per entry of kinds: "empty"; "replayed" (a kept set that
    holds the label, q renormalized over it); "draws" (k draws with replacement from the
    first `pool` ids, so ids repeat inside a row and across tokens)."""
    ids, offs, logq, rep = [], [0], [], []
    for t, kind in enumerate(kinds):
        if kind == "replayed":
            others = [v for v in torch.randperm(V, generator=gen).tolist() if v != int(labels[t])]
            row = [int(labels[t])] + others[:int(torch.randint(0, 5, (1,), generator=gen))]
            q = torch.randn(len(row), generator=gen).log_softmax(0).tolist()
        elif kind == "draws":
            row = torch.randint(0, pool, (k,), generator=gen).tolist()
            q = (torch.rand(k, generator=gen) * -3).tolist()
        else:
            row, q = [], []
        ids += row
        logq += q
        offs.append(offs[-1] + len(row))
        rep.append(kind == "replayed")
    host = np.array(offs, dtype=np.int64)
    return TokenSupport(torch.tensor(ids, dtype=torch.int32), torch.from_numpy(host.copy()),
                        torch.tensor(logq, dtype=torch.float32), torch.tensor(rep), host)


def _centered_coefs(support, gen):
    """Random coefficients on (logp, support_logp) valid for the sparse backward: any on a
    replayed row; on a draws row g_logp = -sum(g_slp) (reinforce with score centering);
    0 on an empty row."""
    N = support.num_rows
    cs = torch.randn(support.nnz, generator=gen, dtype=torch.float64)
    rows = torch.repeat_interleave(torch.arange(N), torch.from_numpy(np.diff(support.host_offsets)))
    row_sum = torch.zeros(N, dtype=torch.float64).index_add(0, rows, cs)
    cl = torch.where(support.replayed, torch.randn(N, generator=gen, dtype=torch.float64), -row_sum)
    G = cl + row_sum  # the coefficient on the log-sum-exp, which the sparse backward drops off the rows
    assert G[~support.replayed].abs().max() < 1e-12
    return cl, cs


def _problem(kinds, seed=0, H=8, V=19, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    N = len(kinds)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.7).to(dtype).requires_grad_()
    labels = torch.randint(0, 6, (N,), generator=gen)  # labels repeat across tokens
    support = _rows_support(kinds, labels, V, gen)
    cl, cs = _centered_coefs(support, gen)
    return hidden, weight, labels, support, cl, cs


def _grads(hidden, weight, labels, support, cl, cs, T, sparse):
    logp, ent, slp = head(hidden, weight, labels, support, T, sparse=sparse)
    loss = (logp.double() * cl).sum() + (slp.double() * cs).sum()
    return (logp, ent, slp), torch.autograd.grad(loss, (hidden, weight))


KINDS = {"replayed": ["replayed"] * 9 + ["empty"] * 2,
         "draws": ["draws"] * 9 + ["empty"] * 2,
         "mixed": ["empty", "replayed", "draws", "draws", "replayed", "empty", "draws", "replayed", "draws"]}


@pytest.mark.parametrize("tile", [None, 40])
@pytest.mark.parametrize("kinds", list(KINDS))
def test_sparse_backward_matches_dense(kinds, tile, monkeypatch):
    if tile is not None:  # many spans and d_W blocks
        monkeypatch.setattr(kernels, "TILE_ELEMENTS", tile)
    hidden, weight, labels, support, cl, cs = _problem(KINDS[kinds])
    fwd_d, (dh_d, dw_d) = _grads(hidden, weight, labels, support, cl, cs, 0.7, sparse=False)
    fwd_s, (dh_s, dw_s) = _grads(hidden, weight, labels, support, cl, cs, 0.7, sparse=True)
    for a, b in zip(fwd_d, fwd_s):  # one forward for both paths
        assert torch.equal(a, b)
    assert not fwd_s[1].requires_grad
    torch.testing.assert_close(dh_s, dh_d, atol=1e-5, rtol=0)
    torch.testing.assert_close(dw_s, dw_d, atol=1e-5, rtol=0)
    assert dh_s.dtype == hidden.dtype and dw_s.dtype == weight.dtype


def _padded(hidden, weight, labels, support, T):
    """The same outputs from a padded [N, K_max] layout with a validity mask, in fp64."""
    N, host = support.num_rows, support.host_offsets
    counts = np.diff(host)
    K = max(1, int(counts.max()))
    mask = torch.arange(K)[None, :] < torch.from_numpy(counts)[:, None]  # (N, K)
    ids = torch.zeros(N, K, dtype=torch.long)
    ids[mask] = support.ids.long()  # row-major mask order is CSR order
    logits = (hidden.double() @ weight.double().T) / T  # (N, V)
    sup = logits.gather(1, ids).masked_fill(~mask, -1e30)  # (N, K); an empty row stays finite
    norm = torch.where(support.replayed, torch.logsumexp(sup, 1), torch.logsumexp(logits, 1))
    logp = logits.gather(1, labels[:, None])[:, 0] - norm
    return logp, (sup - norm[:, None]), mask


def test_ragged_matches_padded():
    hidden, weight, labels, support, cl, cs = _problem(KINDS["mixed"] * 2, seed=3)
    (logp, _, slp), (dh, dw) = _grads(hidden, weight, labels, support, cl, cs, 0.8, sparse=True)
    p_logp, p_slp, mask = _padded(hidden, weight, labels, support, 0.8)
    torch.testing.assert_close(logp.double(), p_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(slp.double(), p_slp[mask], atol=1e-5, rtol=0)
    cs_pad = torch.zeros(mask.shape, dtype=torch.float64)
    cs_pad[mask] = cs
    p_dh, p_dw = torch.autograd.grad((p_logp * cl).sum() + (p_slp * cs_pad).sum(), (hidden, weight))
    torch.testing.assert_close(dh, p_dh, atol=1e-5, rtol=0)
    torch.testing.assert_close(dw, p_dw, atol=1e-5, rtol=0)


def test_sparse_backward_is_deterministic(monkeypatch):
    monkeypatch.setattr(kernels, "TILE_ELEMENTS", 256)  # several d_W blocks added in order
    kinds = (["draws"] * 5 + ["replayed"] * 5 + ["empty"]) * 12
    hidden, weight, labels, support, cl, cs = _problem(kinds, seed=5, H=16, V=40)
    runs = [_grads(hidden, weight, labels, support, cl, cs, 1.0, sparse=True)[1] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_sparse_backward_bf16():
    hidden, weight, labels, support, cl, cs = _problem(KINDS["mixed"], seed=7, dtype=torch.bfloat16)
    _, (dh_d, dw_d) = _grads(hidden, weight, labels, support, cl, cs, 1.0, sparse=False)
    _, (dh_s, dw_s) = _grads(hidden, weight, labels, support, cl, cs, 1.0, sparse=True)
    assert dh_s.dtype == torch.bfloat16 and dw_s.dtype == torch.bfloat16
    torch.testing.assert_close(dh_s.float(), dh_d.float(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(dw_s.float(), dw_d.float(), atol=5e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- with the real loss

def _micro_batch(kind, V, gen, k=4):
    """Four samples packed into one micro-batch; support rows of `kind` on every completion token."""
    samples = []
    for i in range(4):
        prompt = D.Prompt(torch.randint(3, V, (3 + i,), generator=gen).tolist(), "")
        completion = torch.randint(0, 6, (2 + i,), generator=gen).tolist()
        sup = _rows_support([kind] * len(completion), torch.tensor(completion), V, gen, k=k)
        logq = [float(sup.logq[int(sup.host_offsets[j])]) if kind == "replayed"  # the label's q
                else -float(torch.rand(1, generator=gen)) for j in range(len(completion))]
        samples.append(D.Sample(prompt, completion, logq, [0] * len(completion), "stop", sup,
                                advantage=float(torch.randn(1, generator=gen))))
    return data.pack(samples, 64)[0]


SEQ_MASK = dict(seq_mask="geometric", seq_mask_low=0.1, seq_mask_high=10.0)


@pytest.mark.parametrize("kind,cfg", [
    ("draws", Config(loss="reinforce", score_centering_k=4)),
    ("draws", Config(loss="reinforce", score_centering_k=4, **SEQ_MASK)),
    ("draws", Config(loss="icepop", score_centering_k=4, icepop_alpha=0.1, icepop_beta=10.0)),  # not sparse
    ("replayed", Config(loss="icepop", kl_coeff=0.1, top_p=0.9, icepop_alpha=0.1, icepop_beta=10.0)),
    ("replayed", Config(loss="ppo", kl_coeff=0.1, kl_estimator="k1", top_k=5)),
])
def test_sparse_backward_with_the_loss(kind, cfg):
    gen = torch.Generator().manual_seed(11)
    V, H = 23, 8
    mb = _micro_batch(kind, V, gen)
    ok = sparse_ok(cfg, mb.support)
    E.validate([mb], V, cfg)
    denom = L.denominators([mb])
    hidden = torch.randn(64, H, generator=gen, requires_grad=True)
    weight = (torch.randn(V, H, generator=gen) * 0.5).requires_grad_()
    grads = []
    for sparse in (False, True):
        logp, ent, slp = head(hidden, weight, mb.labels, mb.support, cfg.temperature, sparse=sparse)
        loss, _ = L.rl_loss(logp, slp, ent, mb, cfg, denom, 0)
        g_logp, g_slp = torch.autograd.grad(loss, (logp, slp), retain_graph=True, materialize_grads=True)
        if kind == "draws":  # the condition the sparse backward relies on: G_t = 0
            rows = torch.repeat_interleave(torch.arange(64), torch.from_numpy(np.diff(mb.support.host_offsets)))
            G = g_logp + torch.zeros(64).index_add(0, rows, g_slp)
            assert g_logp.abs().max() > 0 and (G.abs().max() <= 1e-6 * g_logp.abs().max()) == ok
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
    (dh_d, dw_d), (dh_s, dw_s) = grads
    assert dh_d.abs().max() > 1e-4  # the loss trains something
    if not ok:  # sparse_ok refuses it, and rightly: the sparse gradient is wrong
        assert (dh_s - dh_d).abs().max() > 1e-4
        return
    torch.testing.assert_close(dh_s, dh_d, atol=1e-6, rtol=0)
    torch.testing.assert_close(dw_s, dw_d, atol=1e-6, rtol=0)


def test_sparse_ok():
    sup = TokenSupport.empty(3)
    assert not sparse_ok(Config(loss="reinforce"), None)
    assert sparse_ok(Config(loss="reinforce"), sup)
    assert not sparse_ok(Config(loss="reinforce", kl_coeff=0.1), sup)
    assert not sparse_ok(Config(loss="icepop"), sup)  # draws rows: the weights break G_t = 0
    assert sparse_ok(Config(loss="icepop", top_p=0.95, kl_coeff=0.1), sup)
    assert sparse_ok(Config(loss="cispo", top_k=20), sup)
    assert sparse_ok(Config(loss="icepop", correction_metrics_only=True), sup)  # trains plain reinforce
