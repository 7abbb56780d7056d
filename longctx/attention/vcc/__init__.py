"""VCC: VIP-token centric compression (paper: Zeng et al., arXiv 2305.04241; method notes:
docs/methods/vcc.md, whose sections the § numbers below cite).

VCC acts on a whole pre-LN layer, not on q, k, v: before each layer the "rest" tokens are
compressed to a short multi-resolution list (the blocks the VIP tokens attend to most stay at
token resolution, every other block of k tokens becomes its mean), the unchanged layer (attention
+ FFN) runs on the compressed rows with a ``+log k`` logit bias on every averaged key, and only
the residual update is decompressed back to the tokens. That is a *stack wrapper*
(DESIGN §2, §4.1): :class:`longctx.attention.vcc.stack.VCCEncoderStack` in an encoder and
:class:`longctx.attention.vcc.stack.VCCDecoderStack` (VCC-LM, our causal extension, §4.2) in a
decoder. The backbone builds it in place of its plain block loop whenever ``model.attention.name``
names this method (capability :meth:`AttentionCore.stack_wrapper`), over the same blocks and
parameter tree (a dense checkpoint loads unchanged).

This package holds the method's config, its validation, and the core every wrapped block carries:
softmax attention over the rows the encoder wrapper hands it, with the wrapper's additive per-key
bias (``log D`` + the straight-through gate, ``-1e9`` on masked rows). The core never runs on its
own: called without ``key_bias`` (i.e. by a plain block loop, which would be exact attention in
place of VCC) it raises. Its contract cases therefore run at the model level (``level='model'``,
tests/models/test_model_contract.py).

Files: ``reference.py`` (the biased softmax, the reference), ``xla.py`` (``chunked``: the same in query chunks),
``layer.py`` (config, implementations, the core). Departures from the paper / reference code are listed in
``longctx/attention/vcc/stack.py``'s docstring (selection score form, two resolutions only, max(count, 1) means,
masked-coarse layout, Python loop instead of scan; VCC-LM's state layout).
Checked against the release (mlpen/VCC at 356f806, ``tests/fidelity/test_vcc_release.py``): a dense layer and two
VCC layers of the encoder stack equal a port of the released RoBERTa encoder (fine-block choice, selection logits,
output) with these departures applied: block means divide by max(count, 1) (the release: count + 1e-4), averaged
keys get exactly log k (the release: log(k + 1e-4)), tanh GELU (the release: erf); with erf GELU the release's
output itself is matched within its epsilons. Also: no projection biases; all-padding blocks score -1e30 (the
release: log 1e-5; neither picks them); masked keys -1e9 (the release: -1000).
"""

from longctx.attention.vcc.layer import VCCAttention, attend, choose, implementations
from longctx.attention.vcc.reference import NEG, biased_attention
from longctx.attention.vcc.xla import chunked_attention

__all__ = ["NEG", "VCCAttention", "attend", "biased_attention", "choose", "chunked_attention", "implementations"]
