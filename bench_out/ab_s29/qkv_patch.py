"""B: the peer layer's q/k/v projections as one fused [d, 3d] Linear (as TransformerBlock.qkv)."""
import sys
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
import peer_eva_release as P


def apply():
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from longctx import attention
    from longctx.models.layers import flat_last

    def our_layer(d_model, heads, window, chunk, proj=True):
        cfg = attention.default_config("eva")
        cfg.update({"window_size": window, "chunk_size": chunk, "overlap_window": False, "use_rpe": True,
                    "adaptive_proj": "qk"})
        D = d_model // heads
        core = attention.build("eva", cfg, num_heads=heads, head_dim=D, causal=True, rngs=nnx.Rngs(0))
        graphdef, core_params, rest = nnx.split(core, nnx.Param, ...)
        ks = jax.random.split(jax.random.key(0), 4)
        pp = {n: (jax.random.normal(k, (d_model, d_model)) * d_model ** -0.5, jnp.zeros((d_model,)))
              for n, k in zip(("q", "k", "v", "o"), ks)}
        params = {"core": core_params, "proj": {"qkv": (jnp.concatenate([pp[n][0] for n in "qkv"], 1),
                                                         jnp.concatenate([pp[n][1] for n in "qkv"])),
                                                 "o": pp["o"]}}

        def layer(params, x):
            B, T, _ = x.shape
            lin = lambda y, n: flat_last(lambda z: z @ params["proj"][n][0] + params["proj"][n][1], y)  # noqa
            qkv = lin(x, "qkv").reshape(B, T, 3, heads, D).transpose(2, 0, 3, 1, 4)
            o, _ = nnx.merge(graphdef, params["core"], rest)(qkv[0], qkv[1], qkv[2])
            o = o.transpose(0, 2, 1, 3).reshape(B, T, d_model)
            return lin(o, "o")

        return params, jax.jit(layer), jax.jit(jax.grad(lambda p, x, w: jnp.sum(layer(p, x) * w), argnums=(0, 1)))

    P.our_layer = our_layer
