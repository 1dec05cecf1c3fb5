"""BlockSizes.float32_dot: both settings right against the float64 reference; bad values refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from ejk_lite import BlockSizes, blocksparse_attention
from ejk_lite.attention import reference


@pytest.mark.parametrize("setting", ["tf32x3", "ieee"])
def test_float32_dot_settings_match_the_reference(setting):
    rng = np.random.default_rng(7)
    q, k, v, w = (jnp.asarray(rng.standard_normal((1, 2, 40, 32)), jnp.float32)
                  for _ in range(4))
    blocks = BlockSizes(16, 16, float32_dot=setting)

    def loss(fn, q, k, v):
        return jnp.sum(w * fn(q, k, v))

    ours = lambda q, k, v: blocksparse_attention(q, k, v, impl="triton", fwd_blocks=blocks,
                                                 bwd_blocks=blocks)
    _, grads = jax.value_and_grad(lambda *a: loss(ours, *a), (0, 1, 2))(q, k, v)
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v)]
        w64 = jnp.asarray(np.asarray(w), jnp.float64)
        ref = reference(*args)
        ref_grads = jax.grad(lambda *a: jnp.sum(w64 * reference(*a)), (0, 1, 2))(*args)
    assert rel_err(ours(q, k, v), ref) < TOLERANCE["float32"]
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < TOLERANCE["float32"]


@pytest.mark.parametrize("bad", ["tf32", "fp32", None])
def test_float32_dot_refuses_other_values(bad):
    with pytest.raises(ValueError, match="float32_dot"):
        BlockSizes(16, 16, float32_dot=bad)
