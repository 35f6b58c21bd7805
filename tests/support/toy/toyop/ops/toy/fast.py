import torch


def toy_attn(q, k, v, scale=None, cu_seqlens=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = torch.einsum('bthd,bshd->bhts', q.float(), k.float()) * scale
    a = a.tril()
    o = torch.einsum('bhts,bshd->bthd', a, v.float())
    return o.to(q.dtype), None


def toy_log(q):
    return (q.float().log() + 1).to(q.dtype), None
