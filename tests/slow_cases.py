"""Which default-suite tests run only with ``-m slow``: those that took longer than :data:`LIMIT_S` seconds in a
default run on the 2-core CI machine (``tests/slow_cases.txt``, read by ``tests/conftest.py``), except the ones
:data:`ALWAYS` keeps in every run (the laws every method must pass and the checks a capability stands on).

Regenerate after a default run with durations (nothing else running):

    bash scripts/test.sh --durations=0 > /tmp/durations.log
    .venv/bin/python tests/slow_cases.py /tmp/durations.log      # rewrites tests/slow_cases.txt, prints the saving

A test marked ``slow`` in its file stays so; this list adds to those marks, it never removes one.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIST = HERE / "slow_cases.txt"
LIMIT_S = 2.5  # the call phase of one test in a default run (two workers on two cores)

# kept in the default run whatever they take: the shared laws (the contract; each implementation against its
# reference in float32; the compute dtype; the protocol) and the one check of a capability no other default test
# covers (the accelerator check's smoke run, a swapped layer in an imported model, attention transfer, the
# exported Transformer-VQ program, training in two processes, resuming after SIGTERM, sharded and sequence-parallel
# steps, stateful sampling and the evaluation protocols, a corpus prepared, trained on and evaluated)
ALWAYS = (
    "tests/attention/test_contract.py::*",
    "tests/attention/test_implementations.py::*float32]",
    "tests/attention/test_compute_dtype.py::*",
    "tests/attention/test_protocol.py::*",
    "tests/attention/test_packed_law.py::*",
    "tests/attention/test_transformer_vq_export.py::*",
    "tests/test_gpu_check.py::test_gpu_check_smoke_writes_every_section*",
    "tests/convert/test_swap.py::*",
    "tests/convert/test_transfer.py::*",
    "tests/train/test_multiprocess.py::*",
    "tests/test_cli_e2e.py::*",
    "tests/models/test_model_contract.py::*",
    "tests/attention/test_implementations.py::test_model_level_*",
    "tests/train/test_resume.py::test_sigterm_then_resume_matches_uninterrupted",
    "tests/train/test_sequence_parallel.py::test_sequence_parallel_equals_single_device_short_row",
    "tests/train/test_sharding.py::test_sharded_steps_equal_single_device_fast",
    "tests/test_sample.py::test_greedy_stateful_decoding_equals_full_recompute",
    "tests/test_evaluate.py::test_stream_and_sliding_agree_with_full_context",
    "tests/data/test_files.py::test_prepare_train_evaluate[[]text folder[]]",
    # the repository's structure (a second or two each, slower only on a loaded machine): rooms, import graph,
    # hygiene; a listed one is off in every default run, and its rule goes unchecked
    "tests/test_rooms.py::*",
    "tests/test_import_graph.py::*",
    "tests/test_repo_hygiene.py::*",
)

_LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")


def base_id(nodeid: str) -> str:
    """A node id without the ``@group`` suffix pytest-xdist's loadgroup adds."""
    return re.sub(r"@[^\]]*$", "", nodeid) if "@" in nodeid.rsplit("]", 1)[-1] else nodeid


def durations(log: str) -> dict[str, float]:
    """node id -> seconds of its call phase from pytest's ``--durations=0`` output (a setup is often a fixture the
    module's tests share: marking its first user slow would move the cost to the next one, not save it)."""
    out: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = _LINE.match(line)
        if m and m.group(2) == "call":
            out[base_id(m.group(3))] += float(m.group(1))
    return dict(out)


def kept(nodeid: str) -> bool:
    return any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in ALWAYS)


def read_list() -> set[str]:
    if not LIST.exists():
        return set()
    return {line.strip() for line in LIST.read_text().splitlines() if line.strip() and not line.startswith("#")}


def main(path: str) -> None:
    times = durations(Path(path).read_text())
    slow = sorted(n for n, t in times.items() if t > LIMIT_S and not kept(n))
    # a case already on the list that this run did not see (it was deselected as slow) stays on it
    slow = sorted(set(slow) | {n for n in read_list() if n not in times})
    LIST.write_text("# tests that run only with -m slow: longer than "
                    f"{LIMIT_S:g} s in a default run (tests/slow_cases.py regenerates this file)\n"
                    + "".join(n + "\n" for n in slow))
    saved = sum(times.get(n, 0.0) for n in slow)
    print(f"{len(slow)} slow cases listed; they took {saved:.0f} of {sum(times.values()):.0f} test-seconds "
          f"in this run (wrote {LIST})")


if __name__ == "__main__":
    main(sys.argv[1])
