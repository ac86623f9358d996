"""The program route of `ghost_oracle.jax`: any JAX function `fun(params, batch)` (the function
jax_privacy's `clipped_grad` clips), captured from its jaxpr rather than from Flax linen modules.

Each example's own loss (`fun(params, batch[i:i+1])`, or `batch[i]` without `keep_batch_dim`) is
traced with `jax.make_jaxpr`, and an interpreter (`interpreter.py`) follows every params leaf
through layout-only steps (reshape, transpose, broadcast_in_dim, convert_element_type, squeeze,
slices, a constant index of a stacked axis, copy: `layout.py`) to its uses:

- `dot_general` with the parameter as one operand (`dot_general.py`): a dense layer, an einsum,
  an attention projection, a tied head `h @ E.T`; rows are the other operand's free axes (a
  `fun` that vmaps over the sequence gives them), batch dimensions on the parameter's side are
  refused. A `conv1d` site (in×out) where that is the parameter's own layout, else `linear`
  (out×in), through a permutation of the parameter where its axes are in another order;
- `gather` of rows of a 2-D table (`gather.py`): an `embedding` site, the ids recorded;
- `mul` by a broadcast parameter, also shifted by a constant (`x̂ ⊙ (1 + w)`): a `layernorm` site;
  `add` of one: a `bias` site (`elementwise.py`);
- `conv_general_dilated` with the parameter as the kernel: a `conv1d` site over unfolded
  patches (`conv.py`).

Sub-programs a parameter enters are followed (`followers.py`): `jit`, `custom_jvp_call`,
`custom_vjp_call`, `remat` are inlined, `cond` evaluates every branch and selects, `scan` and a
`while` with a static trip count are unrolled. A leaf stacked on its first axis and used one
layer at a time (a `scan` over layers) is written as one parameter per layer, `name[l]`, as the
linen route writes `nn.scan`'s layers. Anything else a parameter reaches (squared, divided,
through a nonlinearity, reduced, negated, a product or sum of two parameters, a part of a
parameter, a loop with a data-dependent trip count) is refused by a `TraceExportError` naming
the parameter's key path and the primitive.

Each example's backprops are the gradient of its own loss with respect to a zero perturbation
added to each use's output (`capture.py`); its activations the recorded other operands. Every
use is judged at the precision the program computes it in (the dtype of its operands in the
jaxpr). Before anything is written, `fun(params, batch)` must be the mean or the sum of the
examples' own losses, and the batch gradient rebuilt from the sites must equal `jax.grad` of the
summed per-example losses (the shared core's self-check)."""
from .export import export_program_trace

__all__ = ["export_program_trace"]
