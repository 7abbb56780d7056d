import os
import random
import shutil
import tempfile

import ml_collections
import pytest

# The suite is compile-bound (tiny shapes, hundreds of distinct programs): XLA:CPU's backend optimisations
# and its new fusion emitters cost more compile time than they save in run time (the eva contract cases, one
# process: 65 s -> 36 s at optimisation level 0 -> 25 s with the classic emitters; transformer_vq + decoder
# tests 72 -> 36 s). Set before any backend starts; the subprocesses the tests launch inherit it. An explicit
# setting in XLA_FLAGS wins.
_FLAGS = {"xla_cpu_multi_thread_eigen": "true", "xla_backend_optimization_level": "0",
          "xla_llvm_disable_expensive_passes": "true", "xla_cpu_use_fusion_emitters": "false"}
try:  # jaxlib 0.11's XLA no longer knows this flag, and XLA aborts on an unknown one (seen on the GPU image)
    from importlib.metadata import version as _version

    if tuple(int(x) for x in _version("jaxlib").split(".")[:2]) >= (0, 11):
        del _FLAGS["xla_cpu_use_fusion_emitters"]
except Exception:  # noqa: BLE001 -- no metadata: keep the flags
    pass
_have = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_have] + [f"--{k}={v}" for k, v in _FLAGS.items() if k not in _have]).strip()


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: the suite's flags above (a child given a bare device-count flag
    compiles at full optimisation, 2-3x slower), with ``devices`` simulated host devices."""
    extra = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return (os.environ.get("XLA_FLAGS", "") + extra).strip()


def pytest_configure(config):
    """One JAX persistent compilation cache per test session for the subprocesses the tests start
    (the CLI tests launch the same tiny train step several times), removed at the end, so each
    session starts cold and nothing stale survives it. The test processes themselves do not use it:
    its lookup on every small eager compile cost more than it saved."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    config._longctx_jax_cache = tempfile.mkdtemp(prefix="longctx-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = config._longctx_jax_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The cases of ``tests/slow_cases.txt`` (measured longer than ``tests/slow_cases.py``'s limit in a default
    run) are marked ``slow``: the default run leaves them to ``-m slow``."""
    from tests.slow_cases import base_id, read_list

    slow = read_list()
    if not slow:
        return
    for item in items:
        if base_id(item.nodeid) in slow:
            item.add_marker(pytest.mark.slow)


def pytest_unconfigure(config):
    path = getattr(config, "_longctx_jax_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


def write_corpus(root, n_files=40, seed=0):
    """A folder of small Python-like files, laid out like the built-in corpus."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "True", "x", "y"]
    for i in range(n_files):
        sub = root / ("pkg" if i % 3 else "") / f"mod_{i:03d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"# module {i}"]
        for j in range(rng.randint(20, 60)):
            lines.append("    " * (j % 3) + " ".join(rng.choice(words) for _ in range(rng.randint(2, 8))))
        sub.write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def tiny_corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def tiny_config(corpus, cache, **train):
    from longctx.config import base_config

    c = base_config()
    c.data.path = str(corpus)
    c.data.cache_dir = str(cache)
    c.model.d_model = 32
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.head_dim = 16
    c.model.d_ff = 64
    c.train.steps = 8
    c.train.batch_size = 4
    c.train.seq_len = 32
    c.train.warmup_steps = 2
    c.train.log_every = 1
    c.train.eval_every = 4
    c.train.eval_tokens = 256
    c.train.ckpt_every = 4
    c.train.async_checkpoints = False
    c.eval.max_tokens = 512
    c.sample.num_tokens = 16
    for k, v in train.items():
        c.train[k] = v
    return ml_collections.ConfigDict(c.to_dict())


@pytest.fixture
def tiny_cfg(tiny_corpus, tmp_path):
    return tiny_config(tiny_corpus, tmp_path / "cache")
