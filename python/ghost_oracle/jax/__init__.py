"""JAX side: export a trace of a batch, and assert a clipper's norms or its DP step in one call
(docs/python.md, "JAX"). Two routes, dispatched on the first argument:

**Any JAX program** (the function jax_privacy's `clipped_grad` clips; plain `jnp`, Flax NNX,
Keras 3 on JAX, Equinox, Haiku, a linen model's `apply` wrapped in a function):

    def fun(params, batch):                 # the loss of the examples in batch (B first)
        ...
    assert_norms(fun, params, batch, claimed_norms, max_grad_norm=1.0)   # batch_argnums=1,
    assert_update(fun, params, batch, update, max_grad_norm=1.0, ...)    # keep_batch_dim=True
    export_trace(fun, params, batch, "trace.safetensors", max_grad_norm=1.0)

`batch_argnums` and `keep_batch_dim` are read as `clipped_grad` reads them. Each example's loss
is traced to a jaxpr and its parameters followed to their uses (`program/`: dot_general, gather
of table rows, an elementwise scale or shift, conv_general_dilated; through jit, remat,
custom_jvp/vjp, cond and scan); anything else a parameter reaches is refused by name. A
parameter is named by its pytree key path joined with '.' (`layers.0.w`); a leaf stacked on its
first axis and used a layer at a time (a scan over layers) by its layers, `name[l]`.

**A Flax linen model**, captured by its modules:

    from ghost_oracle.jax import assert_norms

    def per_example_loss(apply, ids):                  # (B,): each example's own loss
        logits = apply(ids)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0].mean(1)

    assert_norms(model, params, per_example_loss, ids, claimed_norms=norms, max_grad_norm=1.0)

Modelled, by exact class: `nn.Dense`, `nn.DenseGeneral`, `nn.Einsum` (N-D kernels flattened to
one linear site), `nn.Embed` and `Embed.attend` (a tied head: two sites of one parameter),
`nn.LayerNorm`, `nn.RMSNorm` (also applied per head), `nn.Conv`, and the `gemma` package's
`Einsum`, `RMSNorm` and `Embedder.encode` / `decode`. Every call is a use of its own. A
parameter is named by its Flax path joined with '.' (`block_0.attn.q.kernel`). `nn.scan` over
layers with `variable_axes={"params": 0}` is replayed layer by layer: a stacked parameter L×… is
written as L parameters, `layers.attn.q.kernel[l]` for layer l (claimed step tensors are given
stacked and split the same way). Anything else that receives a gradient, a scan whose
parameters are broadcast, carried or stacked on another axis, and a modelled module called under
another transformation inside the model (`nn.vmap`, `nn.remat`), is refused by name, never
written as a wrong trace. So is a model that mixes examples (BatchNorm with
`use_running_average=False`, `x - x.mean(0)`, attention across the batch): single examples'
losses are pulled back and must reach every modelled module's output, and the floating-point
inputs, at their own example alone (`probes.py`). `apply` may make state collections other than
'params' mutable (`apply(x, mutable=["batch_stats"])`)."""
from .._trace.format import FORMAT, TraceExportError
from .gate import assert_norms, assert_update
from .trace import UNCLAIMED, export_trace

__all__ = ["FORMAT", "UNCLAIMED", "TraceExportError", "assert_norms", "assert_update", "export_trace"]
