"""The processes a soak starts and restarts: a private redis-server and the `ragkv serve` under test."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

from ragkv.bench.serve.servers import ServerProcess
from ragkv.bench.soak.config import SoakConfig
from ragkv.net import free_port
from ragkv.store.redis_server import INSTALL_HINT, RedisStartError


class _Restartable:
    """A process the soak restarts (`start`, `stop`), as a context manager: started on entry; once exited, no late
    restart may start it again (`closed`, under `lock`)."""

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.closed = True
        self.stop()


class RedisProcess(_Restartable):
    """redis-server on one free 127.0.0.1 port that can be killed and started again on it (no persistence: it
    comes back empty); a context manager that stops it, like `private_redis`."""

    def __init__(self, workdir: Path, maxmemory: str = "256mb", timeout_s: float = 10.0):
        self.workdir, self.maxmemory, self.timeout_s = Path(workdir).resolve(), maxmemory, timeout_s
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.lock, self.closed = threading.Lock(), False  # no start after the exit (a restart thread may be late)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisStartError(f"redis-server is not installed; {INSTALL_HINT}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        with self.lock:
            if self.closed:
                raise RedisStartError("the soak is over; Redis stays stopped")
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
                 str(self.workdir), "--logfile", str(log), "--daemonize", "no", "--maxmemory", self.maxmemory,
                 "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        text = log.read_text()[-2000:] if log.exists() else ""
                        raise RedisStartError(f"redis-server did not start on port {self.port}: {text}") from None
                    time.sleep(0.02)
        finally:
            client.close()
        self.starts += 1

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def stats(self) -> dict:
        """Keys held and hits/misses so far (since this start): whether the server uses the tier at all."""
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=2, socket_timeout=5)
        try:
            info = client.info()
            return {"keys": client.dbsize(), "hits": info.get("keyspace_hits"), "misses": info.get("keyspace_misses"),
                    "used_mb": round(info.get("used_memory", 0) / 2**20, 1)}
        except (redis.exceptions.RedisError, OSError) as e:
            return {"error": str(e)}
        finally:
            client.close()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ServerSupervisor(_Restartable):
    """The `ragkv serve` under test, restartable on its cache folder (a new port each start); a context manager
    that stops whichever one runs."""

    def __init__(self, cfg: SoakConfig, cache_dir: Path, store: str, keys: dict[str, str]):
        self.cfg, self.cache_dir, self.store = cfg, cache_dir, store
        self.extra = tuple(a for t, k in keys.items() for a in ("--api-key", f"{k}:{t}")) + (
            "--max-batch", str(cfg.max_batch)) + (("--kv-memory", cfg.kv_memory) if cfg.kv_memory else ())
        self.server: ServerProcess | None = None
        self.url = ""  # the last started server's, kept while a restart is under way
        self.logs: list[str] = []
        self.lock, self.closed = threading.Lock(), False  # no server outlives the exit (a restart may be late)

    def alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def start(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # at info the server logs each long prefill's admission and end: where a long request's time went
        s = ServerProcess(self.cfg.model, self.cfg.dtype, self.cfg.device, self.store, self.cfg.startup_s,
                          self.cache_dir, self.extra, log_level="info")
        s.__enter__()
        with self.lock:
            if not self.closed:
                self.server, self.url = s, s.url
                self.logs.append(str(s.log_path))
                return
        s.__exit__(None, None, None)
        raise RuntimeError("the soak is over; the server stays stopped")

    def stop(self) -> dict:
        """SIGTERM (SIGKILL after 30 s); its exit code and how long it took."""
        if self.server is None:
            return {}
        t0 = time.monotonic()
        self.server.__exit__(None, None, None)
        out = {"exit_code": self.server.proc.returncode, "stop_s": round(time.monotonic() - t0, 2)}
        self.server = None
        return out

    def log_tail(self, chars: int = 3000) -> str:
        if not self.logs:
            return ""
        return Path(self.logs[-1]).read_text(errors="replace")[-chars:]
