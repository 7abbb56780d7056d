"""Write the compiled HLO of the EVA peer layer's fwd+bwd at T to a file."""
import sys
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
import jax
import peer_eva_release as P
T = int(sys.argv[1]); out = sys.argv[2]
params, f_fwd, f_grad = P.our_layer(256, 4, 128, 8)
x = jax.random.normal(jax.random.key(1), (1, T, 256)); w = jax.random.normal(jax.random.key(2), (1, T, 256))
open(out, "w").write(f_grad.lower(params, x, w).compile().as_text())
