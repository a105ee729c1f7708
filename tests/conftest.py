"""Shared fixtures for the model tests: the golden set, embedded tiny checkpoints, sequence runners.

* ``golden_dir``: the public DeepSeek-V4.1 golden set, copied into ``tests/data/golden_v41``
  (data, see its README).
* ``tiny_checkpoint`` / ``tiny_checkpoint_seed1``: ``make_checkpoint(preset="tiny")`` written once
  per session into a temporary directory (window 16, compress ratios [0,2,2,1,1,1], index_topk 8).
* ``tiny_model``: the tiny checkpoint loaded in the engine's CPU mode (``ModelOptions()``).
* ``run_sequence``: run one sequence through a model, prefill then decode steps, returning logits.
* ``cache_snapshot``: the live per-sequence state in a ``V41Cache`` (window rings, compressed KV,
  index keys, compressor tails, Engram history), keyed by logical position/entry, so two caches
  with different block sizes, block ids and slots can be compared.
* ``golden_platform``: skips a test that asserts the golden set's exact bits on another platform;
  ``on_golden_platform``: whether this is that platform.
* ``parity_process``: the one parity run of the session (``model.parity.main --golden DIR --dump
  FILE``, ~30-40 s single-threaded). When a selected test needs it, it is started in a child
  process right after collection, so it runs on the second core while the other tests run; the
  parity tests wait for it (model tests use one intra-op thread, so the two share 2 cores).
"""

from __future__ import annotations

import os
import shutil

# Idle OpenMP threads sleep instead of spinning. Must be set before torch loads libgomp: with the
# default (active) policy, 2 intra-op threads on 2 cores of which one is busy (the background
# parity run, or any other process) make every parallel region wait for a time slice -- a 20-token
# prefill took 17 s instead of 0.2 s. Only speed is affected, never results.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Without a GPU, Triton kernels run in Triton's interpreter (tiny shapes only). Must be set before
# triton is imported. A machine without nvidia-smi is taken as one without a GPU.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import index_one_element_arrays, skip_repeated_patching

    skip_repeated_patching()  # the same kernels' bits, a third less time (tests/triton_interpreter.py)
    index_one_element_arrays()  # an older interpreter under NumPy >= 2.4 (tests/triton_interpreter.py)

import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from model.attention import ForwardState
from model.batch import ForwardBatch
from model.cache import V41Cache
from model.checkpoint_maker import make_checkpoint
from model.loader import load_model
from model.transformer import ModelOptions, V41Model

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "golden_v41"
REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- data / checkpoints
@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """The copy of the public golden set (cases.json, cases.safetensors, checkpoint/, README.md)."""
    for name in ("cases.json", "cases.safetensors", "README.md", "checkpoint/config.json",
                 "checkpoint/model.safetensors", "checkpoint/engram_token_map.json"):
        assert (GOLDEN_DIR / name).is_file(), f"golden set incomplete: {GOLDEN_DIR / name} is missing"
    return GOLDEN_DIR


def _cpu_vendor() -> str:
    """The CPU's vendor string (``AuthenticAMD``, ``GenuineIntel``; Linux), or "unknown"."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    match = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo, flags=re.M)
    return match.group(1) if match else "unknown"


def golden_platform_check(golden_dir: Path) -> tuple[bool, str]:
    """Whether this is the platform the golden set's bits were computed on, and a sentence saying
    which platform this is otherwise. The set's README (section 1) names the torch CPU build; the
    machine was an x86-64 AMD EPYC. The same torch build on an Intel AVX-512 Xeon gives other bits
    (CPU GEMMs sum in another order there, whatever ``ATEN_CPU_CAPABILITY``, ``MKL_CBWR`` or
    ``ONEDNN_MAX_CPU_ISA`` say), as DeepSeek's own code does (docs/numerics.md, "The verdict")."""
    readme = (golden_dir / "README.md").read_text()
    match = re.search(r"torch (\d+\.\d+\.\d+) \(CPU build\)", readme)
    assert match, "README section 1 names no torch CPU build"
    ours, vendor = torch.__version__.split("+")[0], _cpu_vendor()
    same = (ours == match.group(1) and torch.version.cuda is None and platform.machine() in ("x86_64", "AMD64")
            and vendor == "AuthenticAMD")
    return same, (f"bit-exactness holds on the golden set's platform (torch {match.group(1)} CPU build, x86-64, AMD); "
                  f"this is torch {torch.__version__} on {platform.machine()} ({vendor}), where the statistical "
                  f"verdict applies")


@pytest.fixture(scope="session")
def on_golden_platform(golden_dir: Path) -> bool:
    """Whether CPU arithmetic here sums as on the golden set's own platform."""
    return golden_platform_check(golden_dir)[0]


@pytest.fixture(scope="session")
def golden_platform(golden_dir: Path) -> None:
    """Skips a test that asserts the golden set's exact bits off the set's own platform."""
    same, reason = golden_platform_check(golden_dir)
    if not same:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint_seed1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "seed1", preset="tiny", seed=1)


@pytest.fixture(scope="session")
def single_thread():
    """Run the model tests with one intra-op thread (fast on a shared 2-core machine; the
    thread-count independence itself is tested explicitly). Restored at the end of the session."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path, single_thread) -> V41Model:
    """The tiny checkpoint in the engine's CPU mode (batch-invariant GEMMs, packed attention lists)."""
    return load_model(tiny_checkpoint, ModelOptions())


# ----------------------------------------------------------------------------- running sequences
class OneSequence:
    """One sequence alone in its own cache (slot 0, blocks 1..n), forwarded chunk by chunk.

    Tracks the previous forward's start, which the official index-key hand-off needs.
    """

    def __init__(self, model: V41Model, max_len: int, block_size: int = 128):
        self.model = model
        blocks = -(-max_len // block_size)
        self.cache = V41Cache.allocate(model.cfg, num_blocks=blocks + 1, num_slots=1, block_size=block_size)
        self.block_table = list(range(1, blocks + 1))
        self.slot = 0
        self.length = 0
        self.previous_start = -1

    def forward(self, token_ids: list[int], state: ForwardState | None = None) -> torch.Tensor:
        """Hidden rows [len(token_ids), D] of the next chunk."""
        start = self.length
        batch = ForwardBatch.build([list(token_ids)], [start], [self.slot], [self.block_table],
                                   [self.previous_start])
        hidden = self.model.forward(batch, self.cache, state)
        self.previous_start, self.length = start, start + len(token_ids)
        return hidden

    def logits(self, token_ids: list[int], all_rows: bool = False,
               state: ForwardState | None = None) -> torch.Tensor:
        """fp32 logits of the chunk's last token [V] (or of every token [S, V])."""
        hidden = self.forward(token_ids, state)
        return self.model.logits(hidden) if all_rows else self.model.logits(hidden[-1:])[0]


@dataclass
class SequenceRun:
    prefill: torch.Tensor  # [V] logits of the prompt's last token ([P, V] with all_rows)
    steps: torch.Tensor  # [n, V] logits of every decode step
    states: list[ForwardState] = field(default_factory=list)  # per forward (prefill first), if captured
    sequence: OneSequence | None = None  # the runner, with its cache


def _run_sequence(model: V41Model, prompt: list[int], steps: list[int] = (), *, all_rows: bool = False,
                 capture_states: bool = False, block_size: int = 128) -> SequenceRun:
    """Prefill ``prompt`` in one forward, then feed ``steps`` one token per forward."""
    seq = OneSequence(model, len(prompt) + len(steps), block_size)
    states = []

    def state() -> ForwardState | None:
        if not capture_states:
            return None
        states.append(ForwardState())
        return states[-1]

    prefill = seq.logits(prompt, all_rows=all_rows, state=state())
    step_logits = [seq.logits([tok], state=state()) for tok in steps]
    vocab = model.cfg.vocab_size
    steps_t = torch.stack(step_logits) if step_logits else torch.empty(0, vocab)
    return SequenceRun(prefill, steps_t, states, seq)


@pytest.fixture(scope="session")
def run_sequence():
    """``run_sequence(model, prompt, steps, all_rows=False, capture_states=False, block_size=128)``
    -> ``SequenceRun`` (prefill logits, per-step logits, optional per-forward ``ForwardState``)."""
    return _run_sequence


@pytest.fixture(scope="session")
def one_sequence():
    """The ``OneSequence`` class: one sequence alone in its own cache, forwarded chunk by chunk."""
    return OneSequence


# ----------------------------------------------------------------------------- cache contents
def _cache_snapshot(cache: V41Cache, slot: int, block_table: list[int] | torch.Tensor, length: int) -> dict:
    """The state a sequence of ``length`` cached tokens has in ``cache``: only what a later forward
    can read (rows outside the live window / open group are stale by design), in logical order."""
    cfg = cache.cfg
    table = torch.as_tensor(block_table, dtype=torch.long)
    snap: dict[str, torch.Tensor] = {}
    w = cfg.sliding_window
    window_rows = torch.tensor([p % w for p in range(max(0, length - w), length)], dtype=torch.long)  # oldest first
    for layer in range(cfg.num_layers):
        snap[f"window.layer{layer}"] = cache.read_window(layer, torch.tensor(slot), window_rows)
    for layer in cfg.kv_source_layers:
        ratio = cfg.compress_ratios[layer]
        entries = torch.arange(length // ratio)
        blocks, rows = cache.entry_rows(layer, table, entries)
        snap[f"compressed_kv.layer{layer}"] = cache.read_compressed_kv(layer, blocks, rows)
        snap[f"index_keys.layer{layer}"] = cache.read_index_keys(layer, blocks, rows)
        if ratio > 1:
            open_rows = [p % ratio for p in range(length - length % ratio, length)]
            snap[f"tail_kv.layer{layer}"] = cache.tail_kv[layer][slot, open_rows].clone()
            snap[f"tail_score.layer{layer}"] = cache.tail_score[layer][slot, open_rows].clone()
    h = cache.history_len
    snap["engram_history"] = cache.engram_history[slot, [p % h for p in range(max(0, length - h), length)]].clone()
    return snap


@pytest.fixture(scope="session")
def cache_snapshot():
    """``cache_snapshot(cache, slot, block_table, length)`` -> dict of live state tensors."""
    return _cache_snapshot


def _bitwise_mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the entries of two snapshots that are not bitwise equal (with the max abs diff)."""
    assert a.keys() == b.keys()
    bad = []
    for key in a:
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape and x.numel() else "shape"
            bad.append(f"{key} (max abs {diff})")
    return bad


@pytest.fixture(scope="session")
def bitwise_mismatches():
    """``bitwise_mismatches(snapshot_a, snapshot_b)`` -> names of entries that differ."""
    return _bitwise_mismatches


def _random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="session")
def random_tokens():
    """``random_tokens(vocab, n, seed)``: seeded random token ids."""
    return _random_tokens


# ----------------------------------------------------------------------------- the parity run
# ``mini-deepinfer parity`` as the CLI runs it (``model.parity.main``), with run_parity's return
# value reported on stderr so the tests can check it directly.
_PARITY_SCRIPT = """
import argparse, sys
from model import parity
real_run_parity, returned = parity.run_parity, []
def run_parity(*args, **kwargs):
    returned.append(bool(real_run_parity(*args, **kwargs)))
    return returned[-1]
parity.run_parity = run_parity
parser = argparse.ArgumentParser(prog="parity")
parity.add_arguments(parser)
code = parity.main(parser.parse_args(sys.argv[1:]))
print("run_parity returned", returned, file=sys.stderr)
sys.exit(code)
"""


class ParityProcess:
    """One ``model.parity.main --golden DIR --dump FILE`` run in a child process."""

    def __init__(self, golden_dir: Path):
        self.workdir = Path(tempfile.mkdtemp(prefix="parity-"))
        self.dump_path = self.workdir / "dump.safetensors"
        self.argv = ["--golden", str(golden_dir), "--dump", str(self.dump_path)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        self._stdout = open(self.workdir / "stdout.txt", "w")
        self._stderr = open(self.workdir / "stderr.txt", "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _PARITY_SCRIPT, *self.argv], cwd=REPO_ROOT, env=env,
                                     stdout=self._stdout, stderr=self._stderr)

    def wait(self, timeout: float = 600) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once the run has finished."""
        code = self.proc.wait(timeout=timeout)
        self._stdout.close()
        self._stderr.close()
        return code, (self.workdir / "stdout.txt").read_text(), (self.workdir / "stderr.txt").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for handle in (self._stdout, self._stderr):
            handle.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


_PARITY_KEY = pytest.StashKey[ParityProcess]()


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(session, config, items) -> None:
    if config.option.collectonly or _PARITY_KEY in config.stash or hasattr(config, "workerinput"):
        return  # (xdist workers collect every test: there the fixture starts it on first use)
    if any("parity_process" in getattr(item, "fixturenames", ()) for item in items):
        config.stash[_PARITY_KEY] = ParityProcess(GOLDEN_DIR)


def pytest_unconfigure(config) -> None:
    process = config.stash.get(_PARITY_KEY, None)
    if process is not None:
        process.stop()


@pytest.fixture(scope="session")
def parity_process(request, golden_dir: Path) -> ParityProcess:
    """The session's parity run (started after collection; started here if it was not)."""
    if _PARITY_KEY not in request.config.stash:
        request.config.stash[_PARITY_KEY] = ParityProcess(golden_dir)
    return request.config.stash[_PARITY_KEY]


# ----------------------------------------------------------------------------- frontend on a fake engine
@pytest.fixture(scope="session")
def tokenizer():
    """The embedded tiny model's tokenizer (frontend tests)."""
    from frontend.tokenizer import Tokenizer
    from model.checkpoint_maker import default_model_dir

    return Tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def served(request, tokenizer):
    """A real HTTP server on a fake engine: (server, engine). The test module may set
    ``MODEL`` (served model name) and ``FAKE_ENGINE`` (keyword arguments of serve_fake)."""
    from frontend.fake_engine import serve_fake

    kwargs = dict(getattr(request.module, "FAKE_ENGINE", {}))
    if hasattr(request.module, "MODEL"):
        kwargs["model_name"] = request.module.MODEL
    with serve_fake(tokenizer, **kwargs) as (server, engine):
        yield server, engine


@pytest.fixture
def push_pull():
    """A connected ZeroMQ PUSH -> PULL pair over tcp on localhost: what a worker sends results on,
    and the engine core's end."""
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0)
    pull.close(0)
    context.term()
