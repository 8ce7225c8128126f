"""The chunked head against a dense full-vocabulary computation (plain autograd)."""

import numpy as np
import pytest
import torch

from data import TokenSupport
from kernels import head


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


@pytest.mark.parametrize("chunk", [None, 3])
def test_head_matches_dense(chunk):
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
