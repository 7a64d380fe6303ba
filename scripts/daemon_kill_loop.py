"""kill -9 the daemon under load, restart it, and check every block it returns (issue 47).

Each cycle runs a real ``kvstore serve`` (``python -m kvstore.services.daemon serve``) on one
data directory that outlives the cycles: write-through to its disk tier (the daemon's default),
a host tier of a few hundred slots per namespace, so host copies are evicted all the time and
reads come from the disk. Through it, in this process:

- three plain clients (shared memory, the Unix socket without it, TCP) put fresh chains of
  4 blocks whose bytes are a function of their key (``block_content``: the key's SHAKE-256
  stream as values), and read back random chains acknowledged earlier (this cycle's or any
  before), checking every byte (the reads after a restart may name a key twice: a store
  once filled only one of the two rows, kvstore/store/reads.py);
- an engine (``LLMEngine(store_url=...)``, the seeded tiny random model, a new one each cycle
  with a device pool smaller than its prompts' prefixes) serves prompts whose 5-block
  prefixes repeat, so it reads blocks from the daemon (host hits within a cycle, disk hits
  after a restart) and puts the blocks it computes.

At a random instant after every load thread has done its first operation, the daemon gets
SIGKILL. It is started again on the same directory and checked: every acknowledged client
block of the whole run is found (``contains``), the bytes of this cycle's acknowledged and
unacknowledged-but-present blocks and of a sample of older ones equal ``block_content``, and
every engine block the daemon holds for this cycle's prompts matches the reference. The
restarted daemon carries the next cycle's load. After the last cycle every acknowledged block
is read back once more.

When a put is acknowledged: a socket put when it returns; a shared-memory put returns once its
commit is sent, and the commit's reply is read in front of the client's next request (its next
put, or a get), so the put is acknowledged when that request returns, unless the reply said
its lease had expired (``num_lost_puts`` grew: not stored, the client is told so).

The engine is checked against the same tiny model run with no daemon (greedy): its generated
tokens must be the reference's, and so must its logits of every prompt row after the cached
prefix (``prompt_logits`` with ``skip_reading_prefix_cache=False``) within ``ATOL``. Those rows
attend over the K/V read from the daemon, so a wrong block shows in them directly, where the
greedy tokens alone could hide it. The engine's blocks themselves are checked at the block
level after each restart against the reference's own store, within ``ATOL`` too: the engine
computes a block after a fetched prefix in other batch shapes than the reference does, so its
bytes may differ in the last bits (about 1e-6 measured), while another key's block differs by
about 1, four orders of magnitude above ``ATOL``. Client blocks are compared exactly.

A disk eviction would lose acknowledged blocks by design, so the disk is sized to keep all of
them, and a cycle whose daemon evicted any stops the loop with an error rather than a count.

    .venv/bin/python scripts/daemon_kill_loop.py --cycles 100 [--seed S] [--dir D]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import kvstore
from kvstore import KVLayout
from kvstore.client.client import StoreClient
from kvstore.engine import LLMEngine, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BLOCKS_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32)  # 4 KiB: a disk slot
BLOCKS_MODEL = "kill-loop-blocks"
CHAIN = 4  # blocks per client put
MAX_PUTS = 128  # puts per client and cycle, then only reads: the disk must keep every acknowledged block
CLIENTS = (("shm", True), ("unix", False), ("tcp", False))  # (address, shared memory)
TINY = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100,
            intermediate_size=96)
ENGINE_KW = dict(block_size=4, dtype=torch.float32, random_model=TINY, cpu_decode_kernel=False, prepack_weights=False)
ENGINE_POOL_BLOCKS = 48  # of 2 KiB; the 8 prefixes alone take 40, so prefixes are evicted and fetched
NUM_PREFIXES, PREFIX_TOKENS, NUM_SUFFIXES = 8, 20, 64
BATCH = 4  # prompts per generate
ATOL = 1e-4  # engine logits and blocks vs the reference (see the docstring)
KILL_AFTER_S = (0.05, 1.2)  # the kill's instant, after every load thread's first operation
OLD_SAMPLE = 256  # older acknowledged blocks whose bytes each cycle reads again
READ_KEYS = 4096  # keys one check reads at a time
ENGINE_DISK_BYTES = 32 << 20  # the engine's prompts and outputs: a few thousand blocks of 2 KiB (4 KiB slots)


def block_content(keys: list[bytes], layout: KVLayout = BLOCKS_LAYOUT) -> torch.Tensor:
    """The bytes of each client block, a function of its key alone (any reader can check them)."""
    n = layout.elements_per_block
    rows = [np.frombuffer(hashlib.shake_256(k).digest(2 * n), dtype="<i2") for k in keys]
    flat = np.stack(rows).astype(np.float32) / 4096 if rows else np.empty((0, n), np.float32)
    return torch.from_numpy(flat).reshape(len(keys), *layout.block_shape)


class Daemon:
    """``kvstore serve`` in a subprocess on one data directory, started again after each kill."""

    def __init__(self, data_dir: Path, host_mem: str, disk: str) -> None:
        self.sock_dir = tempfile.mkdtemp(prefix="kvkill-", dir="/tmp")  # short: sun_path is 108 bytes
        self.args = ["--data-dir", str(data_dir), "--host-mem", host_mem, "--disk-size", disk,
                     "--write-policy", "write_through", "--max-namespaces", "2",
                     "--socket", f"{self.sock_dir}/s", "--listen", "127.0.0.1:0", "--http", "none"]
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def start(self, timeout: float = 60.0) -> None:
        """Start it and wait for its "ready" line (printed once it accepts connections)."""
        self.proc = proc = subprocess.Popen([sys.executable, "-m", "kvstore.services.daemon", "serve", *self.args],
                                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, args=(proc, lines), daemon=True).start()
        deadline = time.monotonic() + timeout
        line = ""
        while "ready" not in line:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the daemon was not ready in {timeout} s: {''.join(self.lines[-20:])}") from None
            if not line:
                raise RuntimeError(f"the daemon exited ({proc.wait()}): {''.join(self.lines[-20:])}")
        self.unix = re.search(r"(unix://\S+?),", line).group(1)  # type: ignore[union-attr]
        self.tcp = re.search(r"(tcp://\S+?)[,\s]", line).group(1)  # type: ignore[union-attr]

    def _drain(self, proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)
            lines.put(line)
        lines.put("")  # end of output

    def kill9(self) -> int | None:
        """SIGKILL; returns what the daemon had exited with before it, if it had (None: it ran)."""
        assert self.proc is not None
        before = self.proc.poll()
        self.proc.kill()
        self.proc.wait(30)
        return before

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(30)
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        return code


@dataclass
class Cycle:
    """What one cycle did and found."""

    index: int
    kill_after_s: float = 0.0
    puts_acked: int = 0  # client puts (of CHAIN blocks) acknowledged before the kill
    puts_tried: int = 0
    blocks_verified: int = 0  # client block reads whose bytes were compared, during the load and after
    wrong: int = 0  # client blocks first read with wrong bytes in this cycle
    lost: int = 0  # acknowledged client blocks first found missing in this cycle (load or restart)
    engine_prompts: int = 0  # prompts the engine finished and that were checked
    engine_hit_tokens: int = 0  # prompt tokens the engine read from the daemon (host or disk)
    engine_blocks_verified: int = 0
    engine_wrong: int = 0  # engine outputs (tokens, logits) and blocks off the reference
    errors: list[str] = field(default_factory=list)  # failures with the daemon alive: not expected
    seconds: float = 0.0

    def line(self, cycles: int) -> str:
        return (f"cycle {self.index + 1}/{cycles}: kill at {self.kill_after_s:.2f} s, {self.puts_acked}/"
                f"{self.puts_tried} puts acked, {self.blocks_verified} blocks verified, engine "
                f"{self.engine_prompts} prompts ({self.engine_hit_tokens} tokens from the daemon, "
                f"{self.engine_blocks_verified} blocks verified, {self.engine_wrong} wrong), {self.wrong} wrong, "
                f"{self.lost} lost, {len(self.errors)} errors, {self.seconds:.1f} s")


@dataclass
class Report:
    """The whole run: its cycles and the final read of every acknowledged block."""

    cycles: list[Cycle] = field(default_factory=list)
    final: Cycle = field(default_factory=lambda: Cycle(-1))  # the last read of every acknowledged block
    seconds: float = 0.0

    def total(self, name: str) -> int:
        return sum(getattr(c, name) for c in [*self.cycles, self.final])

    @property
    def wrong(self) -> int:
        """Client blocks ever read wrong, and engine outputs and blocks off the reference."""
        return self.total("wrong") + self.total("engine_wrong")

    @property
    def lost(self) -> int:
        """Acknowledged client blocks ever found missing."""
        return self.total("lost")

    @property
    def blocks_verified(self) -> int:
        return self.total("blocks_verified") + self.total("engine_blocks_verified")

    @property
    def errors(self) -> list[str]:
        return [f"cycle {c.index + 1 if c.index >= 0 else '(final)'}: {e}" for c in [*self.cycles, self.final]
                for e in c.errors]

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and self.lost == 0 and not self.errors

    def summary(self) -> str:
        return (f"kill loop: {len(self.cycles)} cycles, {self.total('puts_acked')} puts acknowledged "
                f"({self.total('puts_acked') * CHAIN} blocks), {self.blocks_verified} blocks verified, "
                f"{self.wrong} wrong, {self.lost} lost acknowledged, {self.total('engine_hit_tokens')} engine "
                f"tokens from the daemon, {len(self.errors)} errors, {self.seconds:.1f} s")


class Ledger:
    """Every client chain of the run, acknowledged or only tried (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: list[list[bytes]] = []  # every acknowledged chain, in order
        self.cycle_start = 0  # acked[cycle_start:] are this cycle's
        self.tried: list[list[bytes]] = []  # this cycle's chains, acknowledged or not
        self.wrong: set[bytes] = set()  # keys ever read with wrong bytes
        self.lost: set[bytes] = set()  # acknowledged keys ever found missing

    def new_cycle(self) -> None:
        with self.lock:
            self.cycle_start, self.tried = len(self.acked), []

    def ack(self, chain: list[bytes]) -> None:
        with self.lock:
            self.acked.append(chain)

    def record(self, cycle: Cycle, verified: int, wrong: list[bytes], absent: list[bytes]) -> None:
        """Count a read of ``verified`` blocks in ``cycle``: each key wrong or lost counts once a run."""
        with self.lock:
            cycle.blocks_verified += verified
            cycle.wrong += len(set(wrong) - self.wrong)
            cycle.lost += len(set(absent) - self.lost)
            self.wrong.update(wrong)
            self.lost.update(absent)

    def sample(self, rng: random.Random, n: int) -> list[list[bytes]]:
        with self.lock:
            return [self.acked[rng.randrange(len(self.acked))] for _ in range(n)] if self.acked else []


def read_blocks(client: StoreClient, keys: list[bytes]) -> tuple[int, list[bytes], list[bytes]]:
    """Read ``keys`` in leading runs, skipping what is absent: (how many were read, the wrong
    ones, the absent ones)."""
    wrong: list[bytes] = []
    absent: list[bytes] = []
    num_read = 0
    for start in range(0, len(keys), READ_KEYS):  # a bounded buffer, whatever the run has put
        part = keys[start : start + READ_KEYS]
        out = torch.empty((len(part), *BLOCKS_LAYOUT.block_shape))
        i = 0
        while i < len(part):
            n = client.fetch(part[i:], into=out[i:]).result(60).num_blocks
            bad = (out[i : i + n] != block_content(part[i : i + n])).flatten(1).any(1).tolist()
            wrong += [k for k, b in zip(part[i : i + n], bad, strict=True) if b]
            num_read += n
            if i + n < len(part):
                absent.append(part[i + n])
            i += n + 1
    return num_read, wrong, absent


class Load:
    """One cycle's load: the clients and the engine, each a thread, until the kill."""

    def __init__(self, daemon: Daemon, ledger: Ledger, engine: EngineCheck, cycle: Cycle, rng: random.Random) -> None:
        self.daemon, self.ledger, self.engine, self.cycle = daemon, ledger, engine, cycle
        self.stop = threading.Event()
        self.killed = threading.Event()
        self.lock = threading.Lock()  # over ``cycle``'s counters
        self.engine_keys: list[list[int]] = []  # token ids of the engine's finished sequences
        self.seeds = [rng.getrandbits(64) for _ in range(len(CLIENTS) + 1)]
        self.threads: list[tuple[threading.Thread, threading.Event]] = []

    def start(self) -> None:
        runs: list[Callable[[threading.Event, random.Random], None]] = [
            functools.partial(self.client, n) for n in range(len(CLIENTS))]
        runs.append(self.serve_prompts)
        for run, seed in zip(runs, self.seeds, strict=True):
            first = threading.Event()
            t = threading.Thread(target=self.guarded, args=(run, first, random.Random(seed)), daemon=True)
            self.threads.append((t, first))
            t.start()

    def wait_started(self, timeout: float = 60.0) -> None:
        """Until every thread did its first operation (or ended)."""
        deadline = time.monotonic() + timeout
        for t, first in self.threads:
            while not first.wait(0.05) and t.is_alive():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a load thread did no operation within {timeout} s")

    def finish(self) -> None:
        self.stop.set()
        for t, _ in self.threads:
            t.join(60)
            if t.is_alive():
                self.cycle.errors.append(f"{t.name} still running 60 s after the kill")

    def guarded(self, run: Callable[[threading.Event, random.Random], None], first: threading.Event,
                rng: random.Random) -> None:
        try:
            run(first, rng)
        except Exception as exc:  # after the kill, any failure of a request is the kill's
            if not self.killed.is_set():
                self.cycle.errors.append(f"with the daemon up: {exc!r}")
        finally:
            first.set()

    def client(self, n: int, first: threading.Event, rng: random.Random) -> None:
        name, shm = CLIENTS[n]
        url = self.daemon.tcp if name == "tcp" else self.daemon.unix
        c = kvstore.connect(url, layout=BLOCKS_LAYOUT, model_id=BLOCKS_MODEL, shm=shm)
        sent: list[bytes] = []  # a shared-memory put whose commit's reply is not read yet
        try:
            for i in range(1 << 30):
                if self.stop.is_set():
                    return
                if i < MAX_PUTS:
                    keys = c.block_keys([self.cycle.index, n, i, rng.getrandbits(30)] + [7] * (CHAIN * 4 - 4))
                    with self.ledger.lock:
                        self.ledger.tried.append(keys)
                    self.count(puts_tried=1)
                    lost = c.num_lost_puts
                    c.put(keys, block_content(keys))
                    sent = self.acked(c, lost, sent, keys if shm else [])  # the put read the reply before it
                    if not shm:
                        self.ledger.ack(keys)
                        self.count(puts_acked=1)
                for chain in self.ledger.sample(rng, 2):
                    lost = c.num_lost_puts
                    self.ledger.record(self.cycle, *read_blocks(c, chain))
                    sent = self.acked(c, lost, sent, [])  # a read settles the commit first
                first.set()
        finally:
            c.abort()

    def acked(self, c: StoreClient, lost_before: int, sent: list[bytes], nxt: list[bytes]) -> list[bytes]:
        """The put ``sent`` was settled by the request that just returned: acknowledged unless its
        lease had expired. Returns what is unsettled now."""
        if sent and c.num_lost_puts == lost_before:
            self.ledger.ack(sent)
            self.count(puts_acked=1)
        return nxt

    def serve_prompts(self, first: threading.Event, rng: random.Random) -> None:
        llm = LLMEngine(None, store_url=self.daemon.unix, fetch_policy="always",
                        kv_cache_bytes=ENGINE_POOL_BLOCKS * 2048, **ENGINE_KW)  # type: ignore[arg-type]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logits=True,
                                skip_reading_prefix_cache=False)
        try:
            while not self.stop.is_set():
                prompts = [self.engine.prompt(rng) for _ in range(BATCH)]
                for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
                    wrong = self.engine.check_output(prompt, out.token_ids, out.prompt_logits, out.prompt_logits_start)
                    hits = out.metrics.cached_tokens["host"] + out.metrics.cached_tokens["disk"]
                    self.count(engine_prompts=1, engine_hit_tokens=hits, engine_wrong=int(wrong))
                    with self.lock:
                        self.engine_keys.append(prompt + out.token_ids[:-1])
                first.set()
        finally:
            with contextlib.suppress(Exception):  # the daemon died under it: its write-back fails
                llm.close()

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self.cycle, name, getattr(self.cycle, name) + delta)


class EngineCheck:
    """The engine's prompts, and the same model with no daemon as their reference."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.prefixes = [[rng.randrange(TINY["vocab_size"]) for _ in range(PREFIX_TOKENS)] for _ in range(NUM_PREFIXES)]
        self.suffixes = [[rng.randrange(TINY["vocab_size"]) for _ in range(rng.randrange(2, 10))]
                         for _ in range(NUM_SUFFIXES)]
        # computes every prompt whole (prompt_logits reads no cache) and keeps its blocks
        self.ref = LLMEngine(None, kv_cache_bytes=1 << 20, host_bytes=64 << 20, **ENGINE_KW)  # type: ignore[arg-type]
        self.params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logits=True)
        self.outputs: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def prompt(self, rng: random.Random) -> list[int]:
        return rng.choice(self.prefixes) + rng.choice(self.suffixes)

    def check_output(self, prompt: list[int], tokens: list[int], logits: torch.Tensor | None, start: int) -> bool:
        """Whether the engine's output is wrong: other tokens, or logits off the reference's."""
        if tuple(prompt) not in self.outputs:
            out = self.ref.generate([prompt], self.params)[0]
            assert out.prompt_logits is not None
            self.outputs[tuple(prompt)] = (out.token_ids, out.prompt_logits)
        want_tokens, want_logits = self.outputs[tuple(prompt)]
        return (tokens != want_tokens or logits is None
                or not torch.allclose(logits, want_logits[start:], rtol=0, atol=ATOL))

    def check_blocks(self, client: StoreClient, sequences: list[list[int]], cycle: Cycle) -> None:
        """Every block the daemon holds for ``sequences`` against the reference's."""
        ref = self.ref.store
        assert ref is not None
        keys = list(dict.fromkeys(k for seq in sequences for k in client.block_keys(seq)))
        # (a block of tokens the reference never produced is a wrong output, counted already)
        held = [k for k, a, b in zip(keys, client.contains(keys), ref.contains(keys), strict=True) if a and b]
        if held:
            got, want = client.get(held), ref.get(held)
            cycle.engine_wrong += int(((got - want).abs().flatten(1).amax(1) > ATOL).sum())
            cycle.engine_blocks_verified += len(held)


def after_restart(daemon: Daemon, ledger: Ledger, engine: EngineCheck, load: Load, rng: random.Random) -> None:
    """The restarted daemon against the ledger and the reference."""
    cycle = load.cycle
    with kvstore.connect(daemon.unix, layout=BLOCKS_LAYOUT, model_id=BLOCKS_MODEL, shm=False) as c:
        every = [k for chain in ledger.acked for k in chain]
        ledger.record(cycle, 0, [], [k for k, ok in zip(every, c.contains(every), strict=True) if not ok])
        acked_now = {k for chain in ledger.acked[ledger.cycle_start :] for k in chain}
        older = ledger.acked[: ledger.cycle_start]
        sample = [k for _ in range(min(OLD_SAMPLE // CHAIN, len(older))) for k in older[rng.randrange(len(older))]]
        ledger.record(cycle, *read_blocks(c, [*acked_now, *sample]))
        unacked = [k for chain in ledger.tried for k in chain if k not in acked_now]
        present = [k for k, ok in zip(unacked, c.contains(unacked), strict=True) if ok] if unacked else []
        num_read, wrong, _ = read_blocks(c, present)  # whatever an unacknowledged put left: exact
        ledger.record(cycle, num_read, wrong, [])
        evicted = c.stats()["disk"]["evictions"]
    llm_ns = engine.ref
    with kvstore.connect(daemon.unix, layout=llm_ns.layout, model_id=llm_ns.model_id, shm=False) as c:
        engine.check_blocks(c, load.engine_keys, cycle)
        evicted += c.stats()["disk"]["evictions"]
    if evicted:
        raise RuntimeError(f"the daemon's disk evicted {evicted} blocks: give it more room (--disk)")


def disk_bytes(cycles: int) -> int:
    """The daemon's disk (two equal namespace shares) for every block ``cycles`` cycles may put."""
    clients = cycles * len(CLIENTS) * MAX_PUTS * CHAIN * BLOCKS_LAYOUT.bytes_per_block
    return 2 * (max(clients, ENGINE_DISK_BYTES) + (8 << 20))


def run_loop(cycles: int, seed: int = 0, data_dir: Path | None = None, disk: str | None = None,
             host_mem: str = "2MiB", progress: Callable[[str], None] | None = print) -> Report:
    """``cycles`` kill -9 cycles of one daemon under load; see the module docstring.

    Args:
        cycles: kills (and restarts) of the daemon.
        seed: seeds the kill instants, the keys and the engine's prompts.
        data_dir: the daemon's data directory, kept (None: a temporary one, removed after).
        disk: the daemon's --disk-size (None: ``disk_bytes(cycles)``).
        host_mem: the daemon's --host-mem (two namespace shares).
        progress: called with each cycle's line.

    Returns:
        The report: per cycle, and the final read of every acknowledged block.
    """
    t0 = time.monotonic()
    rng = random.Random(seed)
    own_dir = data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="kvkill-data-")) if data_dir is None else data_dir
    report, ledger, engine = Report(), Ledger(), EngineCheck(seed)
    daemon = Daemon(data_dir / "daemon", host_mem, disk or f"{disk_bytes(cycles) >> 20}MiB")
    daemon.start()
    try:
        for i in range(cycles):
            t = time.monotonic()
            cycle = Cycle(i, kill_after_s=rng.uniform(*KILL_AFTER_S))
            ledger.new_cycle()
            load = Load(daemon, ledger, engine, cycle, rng)
            load.start()
            load.wait_started()
            time.sleep(cycle.kill_after_s)  # the random instant of the kill: the point, not a wait
            load.killed.set()
            if (code := daemon.kill9()) is not None:
                cycle.errors.append(f"the daemon had exited ({code}) before the kill")
            load.finish()
            daemon.start()
            after_restart(daemon, ledger, engine, load, rng)
            cycle.seconds = time.monotonic() - t
            report.cycles.append(cycle)
            if progress:
                progress(cycle.line(cycles))
        with kvstore.connect(daemon.unix, layout=BLOCKS_LAYOUT, model_id=BLOCKS_MODEL, shm=False) as c:
            ledger.record(report.final, *read_blocks(c, [k for chain in ledger.acked for k in chain]))
    finally:
        if (code := daemon.stop()) != 0:
            report.final.errors.append(f"the daemon exited {code} on SIGTERM")
        engine.ref.close()
        if own_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
    report.seconds = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=100, help="kill -9 cycles (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill instants, keys and prompts (default 0)")
    p.add_argument("--dir", type=Path, default=None,
                   help="data directory, kept after the run (default: a temporary one, removed)")
    p.add_argument("--disk", default=None,
                   help="the daemon's --disk-size, split over 2 namespaces (default: room for every block put)")
    args = p.parse_args(argv)
    if args.cycles < 1:
        p.error(f"--cycles must be at least 1, got {args.cycles}")
    # the engine's demoter and the clients log the requests the kill cuts short: expected here
    logging.getLogger("kvstore").setLevel(logging.CRITICAL)
    report = run_loop(args.cycles, args.seed, args.dir, args.disk)
    for error in report.errors[:10]:
        print(error)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
