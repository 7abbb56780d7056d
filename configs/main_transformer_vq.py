"""The previous main job (configs/main.py until the sliding-window model replaced it): a Transformer-VQ language
model over BPE tokens on the built-in corpus, sized to train on a 2-core CPU.

Transformer-VQ with GAU blocks (configs/builtin/transformer_vq.py: d_model 256, one head with Dk 128, value width
384, codebook 64, blocks of 64) at 4 GAUs, over the main job's byte-level BPE of 4,096 tokens, trained on rows of
1024 tokens in windows of 256 that carry the compressed cache under stop-gradient (one update per window), batch 8,
peak learning rate 3e-3, 3,600 updates. Test bytes are scored as one stream per document with the cache carried.

    CONFIG=configs/main_transformer_vq.py WORKDIR=runs/main_tvq bash scripts/main.sh

Test 1.3921 bits per byte in 26 min 50 s for that whole command (BENCHMARKS.md, "main job's recipe"); reset every
4 KiB it scores better (1.3666): its carried cache does not yet pay.
"""

from configs.builtin import transformer_vq


def get_config():
    c = transformer_vq.get_config()
    c.data.tokenizer = "bpe"
    c.data.options.vocab_size = 4096
    c.model.num_layers = 4  # GAUs
    c.train.batch_size = 8
    c.train.seq_len = 1024
    c.train.window = 256
    c.data.packing = "document"  # as measured (rows inside one file; the default 'auto' would pack the files)
    c.train.steps = 3600  # updates (windows): 7.4M training tokens, about 25 MB of text
    c.train.lr = 3e-3
    c.train.warmup_steps = 100
    c.train.eval_every = 900
    c.train.ckpt_every = 500
    c.eval.row_len = -1  # stream each test document whole, state carried
    return c
