"""JAX side: export a trace of a Flax linen model on a batch, and assert a clipper's norms or
its DP step in one call (docs/python.md, "JAX").

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
