"""200 sampled (temperature 1.0) forced tool calls whose argument must hold `</tool_call>`, against a real
`ragkv serve` on 127.0.0.1 (the default model), each reply judged by ragkv/bench/soak/abuse.py `contract_broken`.
Run from the repository root: `.venv/bin/python scripts/check_sampled_tool_calls.py` (about 5 minutes on 2 cores)."""

import json
import subprocess
import time

import httpx

from ragkv.bench.soak.abuse import TAG_TOOL, contract_broken
from ragkv.net import free_port

port = free_port()
proc = subprocess.Popen([".venv/bin/ragkv", "serve", "--host", "127.0.0.1", "--port", str(port)],
                        stdout=subprocess.DEVNULL, stderr=open("/tmp/sampled_calls_server.log", "w"))
url = f"http://127.0.0.1:{port}"
try:
    for _ in range(240):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    counts, broken = {}, []
    t0 = time.time()
    with httpx.Client(timeout=120) as http:
        for i in range(200):
            body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the weather in the city?"}],
                    "max_tokens": 64, "temperature": 1.0, "seed": i, "tools": [TAG_TOOL], "tool_choice": "required"}
            r = http.post(url + "/v1/chat/completions", json=body)
            why = contract_broken("abuse_tool_tag", r.status_code, r.text if r.status_code == 200 else "")
            key = f"{r.status_code} " + (r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else "")
            counts[key] = counts.get(key, 0) + 1
            if why:
                broken.append((i, why, r.text[:200]))
    print(json.dumps({"sent": 200, "by_status_and_finish": counts, "broken": len(broken), "examples": broken[:5],
                      "seconds": round(time.time() - t0, 1)}, indent=1))
finally:
    proc.terminate()
    proc.wait(30)
