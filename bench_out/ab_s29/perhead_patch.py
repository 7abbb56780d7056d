"""B: the peer layer's projections per head: q/k/v come out head-major and the output projection sums per-head
products, so no [B,T,H,D] <-> [B,H,T,D] transposes."""
import sys
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
import peer_eva_release as P


def apply():
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from longctx import attention

    orig = P.our_layer

    def our_layer(d_model, heads, window, chunk, proj=True):
        params, _, _ = orig(d_model, heads, window, chunk, proj)
        cfg = attention.default_config("eva")
        cfg.update({"window_size": window, "chunk_size": chunk, "overlap_window": False, "use_rpe": True,
                    "adaptive_proj": "qk"})
        D = d_model // heads
        core = attention.build("eva", cfg, num_heads=heads, head_dim=D, causal=True, rngs=nnx.Rngs(0))
        graphdef, _, rest = nnx.split(core, nnx.Param, ...)

        def layer(params, x):
            B, T, _ = x.shape
            x2 = x.reshape(B * T, d_model)

            def heads_of(n):
                W, b = params["proj"][n]
                return jnp.stack([x2 @ W[:, h * D:(h + 1) * D] + b[h * D:(h + 1) * D] for h in range(heads)])[None]

            o, _ = nnx.merge(graphdef, params["core"], rest)(heads_of("q"), heads_of("k"), heads_of("v"))
            Wo, bo = params["proj"]["o"]
            out = sum(o[0, h] @ Wo[h * D:(h + 1) * D] for h in range(heads)) + bo
            return out.reshape(B, T, d_model)

        return params, jax.jit(layer), jax.jit(jax.grad(lambda p, x, w: jnp.sum(layer(p, x) * w), argnums=(0, 1)))

    P.our_layer = our_layer
