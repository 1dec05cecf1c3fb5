"""ejk_lite: small, complete, differentiable Triton kernels for JAX.

Importing the package settles how kernels run: through jax-triton on a CUDA GPU, or through
Triton's interpreter on a machine without one (see :mod:`ejk_lite.launch`).

Every op lives in a module whose name is not the op's: ``ejk_lite.cumsum`` (``chunk_local_cumsum``,
``chunk_global_cumsum``), ``ejk_lite.pooling`` (``mean_pooling``, ``block_mean_pooling``),
``ejk_lite.linear_attention`` (``recurrent``), ``ejk_lite.attention`` (``blocksparse_attention``);
so ``import ejk_lite.pooling as m`` gives the module, with its ``reference``. Shared argument checks
live in ``ejk_lite.checks``.
"""

from ejk_lite.launch import INTERPRETER, ON_GPU, triton_call  # first: settles TRITON_INTERPRET
from ejk_lite.packing import (
    cdiv,
    identity_dtype_convert,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_cu_seqlens_from_mask,
    prepare_lens,
    prepare_lens_from_mask,
    prepare_position_ids,
    prepare_sequence_ids,
    prepare_token_indices,
    validate_cu_seqlens,
)
from ejk_lite.cumsum import CumsumConfig, chunk_global_cumsum, chunk_local_cumsum
from ejk_lite.pooling import PoolingConfig, block_mean_pooling, mean_pooling
from ejk_lite.linear_attention import RecurrentConfig, recurrent
from ejk_lite.chunked import ChunkedConfig, KernelConfig, chunked_recurrent
from ejk_lite.masking import BlockMask, intersection, make_block_mask, union
from ejk_lite.attention import BlockSizes, blocksparse_attention

__version__ = "0.1.0"
