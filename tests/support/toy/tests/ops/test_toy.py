import pytest
import torch
from toyop.ops.toy import toy_attn
from toyop.ops.toy.naive import naive_toy_attn


@pytest.mark.parametrize('T', [5, 17])
def test_toy(T):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 8) for _ in range(3))
    torch.testing.assert_close(toy_attn(q, k, v)[0], naive_toy_attn(q, k, v)[0], rtol=1e-4, atol=1e-4)
