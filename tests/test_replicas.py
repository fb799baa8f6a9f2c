"""`ragkv serve --replicas 2` on a real local Ray Serve (127.0.0.1): the single server's API through Ray Serve's
proxy, each passage set answered by the replica holding its blocks, and a replica killed mid-answer failing only
its own requests while Ray starts another, and every socket of the server and its Ray on loopback."""

import ipaddress
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from ragkv.bench.replica_soak import descendants_named
from ragkv.bench.serve import ServerProcess
from ragkv.net import is_loopback
from tiny import default_model_available

pytest.importorskip("ray.serve", reason="the replicas extra (ray[serve]) is not installed")
pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]

KEY_A, KEY_B = "key-replicas-a-01", "key-replicas-b-02"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    extra = ("--replicas", "2", "--replica-threads", "1", "--api-key", f"{KEY_A}:tenantA",
             "--api-key", f"{KEY_B}:tenantB", "--no-startup-profile", "--timeout", "120")
    with ServerProcess(dtype="float32", device="cpu", store="memory:256MiB", startup_s=300,
                       cache_dir=tmp_path_factory.mktemp("replicas"), extra=extra) as s:
        yield s


def passages(name: str) -> list[str]:
    return [f"Report {name}-{i}: the {name} bridge section {i} was finished in {1890 + i} by the crew of "
            f"foreman {name.title()}{i}, who used {i + 3} cranes." for i in range(3)]


def ask(server, name: str, reverse: bool = False, headers=A, **kw) -> httpx.Response:
    docs = passages(name)
    body = {"model": "smollm2", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"When was the {name} bridge section 1 finished?"}],
            "documents": docs[::-1] if reverse else docs, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_each_passage_set_is_answered_by_the_replica_holding_its_blocks(server):
    replica_of, cached = {}, {}
    for rnd in range(3):
        for name in ("north", "south", "east", "west"):
            r = ask(server, name, reverse=rnd == 1)  # any order of the same passages: the same blocks
            assert r.status_code == 200, r.text
            replica = r.headers["x-ragkv-replica"]
            assert replica_of.setdefault(name, replica) == replica, f"{name} moved replicas in round {rnd}"
            cached[name, rnd] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    for name in ("north", "south", "east", "west"):
        # the first answer encoded the passages (its system prompt may be cached); the later ones found them all
        assert cached[name, 1] > cached[name, 0] + 60 and cached[name, 2] == cached[name, 1], cached


def test_the_single_server_api_keys_and_errors_through_the_proxy(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "smollm2", "messages": []}, timeout=60)
    assert r.status_code == 401 and r.headers["x-ragkv-replica"]
    r = ask(server, "north", max_tokens=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = ask(server, "north", ragkv={"namespace": "tenantB"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "namespace_forbidden"
    models = httpx.get(server.url + "/v1/models", headers=A, timeout=60)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "smollm2"
    # tenants do not share blocks, on one replica or another: B's first ask of A's passages encodes them
    before = ask(server, "north", headers=A).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    other = ask(server, "north", headers=B).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert other < before


def stream(server, name: str, out: dict) -> None:
    """One long streamed answer; records its replica, its chunks and how it ended."""
    docs = passages(name)
    body = {"model": "smollm2", "max_tokens": 160, "min_tokens": 160, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Tell the story of the {name} bridge."}], "documents": docs}
    out.update(chunks=0, finish=None, error=None, status=None, tokens=None)
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=A, timeout=120) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get("x-ragkv-replica")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                if event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
                if not event.get("choices"):  # the usage chunk
                    continue
                out["chunks"] += 1
                out["finish"] = event["choices"][0].get("finish_reason") or out["finish"]
    except httpx.HTTPError as e:
        out["error"] = {"code": type(e).__name__}


def engine_replica_pids(root: int) -> list[int]:
    """Pids of the EngineReplica actors under the server process `root` (never another Ray's)."""
    return descendants_named(root, "ServeReplica:ragkv:EngineReplica")


def test_a_killed_replica_fails_only_its_own_requests_and_is_replaced(server):
    docs = [{"id": f"doc-{i}", "text": f"Acknowledged document {i}: the tide table of harbour {i}."}
            for i in range(2)]
    r = httpx.post(server.url + "/v1/documents", json={"documents": docs}, headers=A, timeout=300)
    assert r.status_code == 200, r.text  # acknowledged: committed to the library the replicas share
    # two passage sets the router sends to different replicas
    names, seen = [], {}
    for name in ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"):
        replica = ask(server, name).headers["x-ragkv-replica"]
        if replica not in seen:
            seen[replica] = name
            names.append(name)
        if len(names) == 2:
            break
    assert len(names) == 2, f"every set went to one replica: {seen}"
    pids = engine_replica_pids(server.proc.pid)
    assert len(pids) == 2, pids

    outs = [{} for _ in names]
    threads = [threading.Thread(target=stream, args=(server, n, o)) for n, o in zip(names, outs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(o.get("chunks", 0) >= 3 for o in outs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(o.get("chunks", 0) >= 3 for o in outs), outs  # both answers are streaming
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    failed = [o for o in outs if o["finish"] != "length" or o["error"]]
    done = [o for o in outs if o["finish"] == "length" and not o["error"]]
    # exactly one answer was on the killed replica: it ends with an error event; the other's is whole
    assert len(failed) == 1 and len(done) == 1, outs
    assert failed[0]["error"] is not None and failed[0]["replica"] != done[0]["replica"]
    assert done[0]["tokens"] == 160  # whole (a loaded server may send several tokens a chunk: count tokens)

    # Ray starts a replacement; meanwhile and after, every request is answered (by the survivor at worst)
    deadline = time.monotonic() + 180
    while len(engine_replica_pids(server.proc.pid)) < 2 and time.monotonic() < deadline:
        r = ask(server, names[0])
        assert r.status_code in (200, 503), r.text
        time.sleep(1)
    assert len(engine_replica_pids(server.proc.pid)) == 2
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        r = ask(server, names[0])
        if r.status_code == 200:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
    listed = httpx.get(server.url + "/v1/documents", headers=A, timeout=60).json()["data"]
    assert {"doc-0", "doc-1"} <= {d["doc_id"] for d in listed}  # no acknowledged document lost


def listening_sockets(root: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in the process tree of `root` (Linux /proc)."""
    inodes = {}
    for pid in [root] + descendants_named(root, ""):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:  # a process that ended meanwhile
            continue
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)  # the kernel writes each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16), inodes[fields[9]]))
    return found


def test_every_socket_of_the_server_and_its_ray_listens_on_loopback(server):
    found = listening_sockets(server.proc.pid)
    ports = {port for _, port, _ in found}
    # the driver, GCS, raylet, agents, controller, proxy and three replicas listen: all seen
    assert server.port in ports and len({pid for *_, pid in found}) >= 8, found
    outside = [s for s in found if not is_loopback(s[0])]
    assert not outside, f"listening beyond loopback: {outside}"
