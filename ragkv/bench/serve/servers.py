"""`ragkv serve` as a subprocess on a free 127.0.0.1 port (also what the server tests start), and what the
benchmark reads from it besides the answers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragkv.errors import InvalidRequestError, RagkvError
from ragkv.net import free_port


def default_threads() -> int:
    """The thread count `ragkv serve` computes with by default (torch's intra-op threads)."""
    try:
        import torch
        return torch.get_num_threads()
    except ImportError:
        return os.cpu_count() or 1


class ServerSubprocess:
    """A server subprocess on a free 127.0.0.1 port, its output in a log file, ready once `ready_path` answers
    200; a context manager that stops it on exit. Subclasses set `cmd`, `startup_s`, `name` and `_spawn`."""

    name = "server"
    ready_path = "/health"

    def _wait_ready(self) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._stop()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self._stop()
        raise RuntimeError(f"{self.name} did not answer {self.ready_path} in {self.startup_s:.0f} s:\n"
                           f"{self._log_tail()}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server so far (Linux /proc), or None where unavailable."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def rss_bytes(self) -> int | None:
        """The server's resident memory now (Linux /proc VmRSS: what the system sees, not an allocator's count),
        or None where unavailable."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def _python_prints(self, code: str) -> str | None:
        """What the server's own python prints for `code` (a peer's version), or None."""
        out = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or None

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def model_gguf(model: str) -> Path:
    """The GGUF a known model is converted from (the file the registry converts on first use)."""
    from ragkv.models.registry import KNOWN_MODELS, gguf_path

    known = KNOWN_MODELS.get(model)
    if known is None:
        raise InvalidRequestError(f"--peer needs the model's GGUF: {model!r} is not a known model "
                                  f"({', '.join(KNOWN_MODELS)}); pass --peer-gguf PATH")
    return gguf_path(known)


class PeerServerProcess(ServerSubprocess):
    """A peer's server started from `cmd` (+ --port), its log in a throw-away folder; a context manager. Subclasses
    set `cmd`, `startup_s`, `name`, `log_name`, and `env` (added to the environment) and `new_session` if needed."""

    log_name = "peer"
    env: dict | None = None
    new_session = False  # its own session, to count and stop the children it starts with it

    def __enter__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix=f"ragkv-bench-{self.log_name}-", ignore_cleanup_errors=True)
        self.port = free_port()
        self.log_path = Path(self.tmp.name) / f"{self.log_name}-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **self.env} if self.env else None,
                                     start_new_session=self.new_session)
        try:
            self._wait_ready()
        except BaseException:
            self._stop()
            self.tmp.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        self.tmp.cleanup()


class ServerProcess(ServerSubprocess):
    """`ragkv serve` as a subprocess on a free port; a context manager.

    Its cache folder (KV disk tier, index, log) is `cache_dir`, or a throw-away one when None.
    """

    name = "ragkv serve"

    def __init__(self, model: str = "smollm2", dtype: str = "float32", device: str = "auto",
                 store: str = "memory:2GiB", startup_s: float = 300.0, cache_dir: Path | None = None,
                 extra: tuple[str, ...] = (), threads: int | None = None, log_level: str = "warning"):
        self.model, self.dtype = model, dtype
        self.threads = threads  # torch's threads in the server (None: its default, every core)
        self.cmd = [sys.executable, "-m", "ragkv.cli", "--log-level", log_level, "serve", "--model", model, "--dtype", dtype,
                    "--device", device, "--store", store, *extra]
        self.startup_s = startup_s
        self.cache_dir = cache_dir

    def __enter__(self) -> "ServerProcess":
        self.spawn()
        self.wait_ready()
        return self

    def spawn(self) -> None:
        """Start the process; `wait_ready` waits for it (apart, so several servers start at once)."""
        from ragkv.config import models_dir

        self.tmp = None if self.cache_dir else tempfile.TemporaryDirectory(prefix="ragkv-bench-serve-",
                                                                           ignore_cleanup_errors=True)
        root = Path(self.cache_dir) if self.cache_dir else Path(self.tmp.name)
        self.port = free_port()
        env = dict(os.environ, RAGKV_CACHE_DIR=str(root), RAGKV_MODELS_DIR=str(models_dir()))
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path = root / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port), "--index", str(root / "index")],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        try:
            try:
                self._wait_ready()
            except RuntimeError:
                if not self._lost_its_port():
                    raise
                if self.tmp is not None:
                    self.tmp.cleanup()
                self.spawn()  # another process took the port between our choice and the server's bind: once more
                self._wait_ready()
        except BaseException:
            if self.tmp is not None:
                self.tmp.cleanup()
            raise

    def _lost_its_port(self) -> bool:
        log = self._log_tail().lower()
        return "address already in use" in log or "failed to bind" in log

    def __exit__(self, *exc) -> None:
        self._stop()
        if self.tmp is not None:
            self.tmp.cleanup()


@contextlib.contextmanager
def started_together(servers: list[ServerProcess]):
    """Start every server at once, wait until all answer, stop them all on exit: their start-ups (imports, model
    loading) overlap instead of queueing."""
    with contextlib.ExitStack() as stack:
        for s in servers:
            s.spawn()
            stack.callback(s.__exit__)
        for s in servers:
            s.wait_ready()
        yield servers


def _wait_health_zero(base: str, field: str, timeout_s: float, every_s: float) -> None:
    """Poll the server's /health until `field` reads 0 (absent counts as 0), or `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while httpx.get(base + "/health", timeout=10).json().get(field, 0) and time.monotonic() < deadline:
        time.sleep(every_s)


def wait_written(base: str, timeout_s: float = 60.0) -> None:
    """Wait until the server at `base` has no new block on its way to a slower tier (its /health
    `write_back_pending`), or `timeout_s`."""
    _wait_health_zero(base, "write_back_pending", timeout_s, 0.1)


def wait_idle(base: str, timeout_s: float = 600.0) -> None:
    """Wait until the server at `base` has no background job left (its start-up profile, whose forwards would
    otherwise run between the benchmark's requests), or `timeout_s`."""
    _wait_health_zero(base, "background_jobs", timeout_s, 0.2)


def cpu_seconds_of(servers: list[ServerProcess]) -> float | None:
    """The servers' CPU time so far, together (None where any is unreadable)."""
    cpu = [s.cpu_seconds() for s in servers]
    return None if None in cpu else sum(cpu)


def find_program(candidates: list[Path], check: list[str], broken: str, missing: str, hint: str,
                 timeout_s: float = 120, env: dict | None = None) -> Path:
    """The first of `candidates` that exists (as a path, else on PATH), if running it with `check` succeeds.
    Raises with the install `hint`: "<found> <broken> (its last error line)", or "<missing> (no ...)"."""
    import shutil

    for c in candidates:
        found = c if c.is_file() else (Path(shutil.which(str(c))) if shutil.which(str(c)) else None)
        if found is None:
            continue
        run = subprocess.run([str(found), *check], capture_output=True, text=True, timeout=timeout_s, env=env)
        if run.returncode == 0:
            return found
        raise RagkvError(f"{found} {broken} ({(run.stderr.strip().splitlines() or ['?'])[-1]}); " + hint)
    raise RagkvError(f"{missing} (no {' or '.join(map(str, candidates))}); " + hint)


def beside_checkout(default: str) -> list[Path]:
    """`default` in the working directory, then beside the ragkv checkout: where the install scripts put peers."""
    return [Path(default), Path(__file__).resolve().parents[3] / default]


def find_venv_python(path: str | None, default: str, probe: str, what: str, hint: str, timeout_s: float = 120,
                     env: dict | None = None) -> Path:
    """The python of a peer's own virtualenv: `path`, else `default` in the working directory or beside the
    checkout (found on PATH too), that can run `probe`. Raises with the install `hint` when none is found or the
    one found cannot run it."""
    candidates = [Path(path).expanduser()] if path else beside_checkout(default)
    return find_program(candidates, ["-c", probe], f"cannot import {what}", f"the {what} peer is not installed",
                        hint, timeout_s, env)
