"""The round-3 probe classes re-run against a live server on loopback (README.md beside it).

python probe.py PORT   # a server started with --body-timeout 8 --max-connections 4
"""

import json
import socket
import sys
import time

import httpx

HOST, PORT = "127.0.0.1", int(sys.argv[1])
URL = f"http://{HOST}:{PORT}"
results = []


def check(name, ok, detail=""):
    results.append((name, ok, detail))
    print(("PASS" if ok else "FAIL"), name, detail, flush=True)


def first(b):
    return b.split(b"\r\n")[0].decode() if b else ""


def raw(data: bytes, wait=5.0):
    s = socket.create_connection((HOST, PORT))
    s.settimeout(wait)
    s.sendall(data)
    t0 = time.monotonic()
    buf = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if b"\r\n\r\n" in buf:
                break
    except TimeoutError:
        pass
    s.close()
    return buf, time.monotonic() - t0


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
body = json.dumps({"model": "demo", "prompt": "def f(", "max_tokens": 2, "temperature": 0}).encode()
# 1. a Content-Length 100 bytes longer than the body: answered at once or by the body timeout
resp, dt = raw(
    HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (len(body) + 100) + body,
    wait=15,
)
check(
    "short body answered", resp.startswith(b"HTTP/1.1 4"), (first(resp) or "no answer") + f" after {dt:.1f}s"
)
# 1b. a chunked body trickled 1 byte per 2 s: cut by the body timeout
s = socket.create_connection((HOST, PORT))
s.settimeout(30)
s.sendall(HEAD + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
t0 = time.monotonic()
got = b""
try:
    for _ in range(20):
        s.sendall(b"1\r\n{\r\n")
        time.sleep(2)
        s.setblocking(False)
        try:
            got += s.recv(4096)
        except BlockingIOError:
            pass
        s.setblocking(True)
        s.settimeout(30)
        if got:
            break
except (BrokenPipeError, ConnectionResetError):
    pass
s.close()
check(
    "trickled body cut",
    got.startswith(b"HTTP/1.1 408") or time.monotonic() - t0 < 40,
    (first(got) or "closed") + f" after {time.monotonic() - t0:.0f}s",
)
c = httpx.Client(base_url=URL, timeout=30)


def post(path, payload=None, content=None, headers=None):
    return c.post(path, json=payload, content=content, headers=headers)


r = post("/v1/completions", content=body, headers={"Content-Type": "text/plain"})
check("text/plain 415", r.status_code == 415, str(r.status_code))
r = c.post("/v1/completions", content=body, headers={"Content-Type": ""})
check("no content type 415", r.status_code == 415, str(r.status_code))
base = {"model": "demo", "prompt": "def f(", "max_tokens": 2}
chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
for name, path, extra in [
    ("response_format", "/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("tools", "/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("tool_choice", "/v1/chat/completions", {"tool_choice": "required"}),
    ("suffix", "/v1/completions", {"suffix": "x"}),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"top_logprobs": 2}),
    ("stream_options 0", "/v1/completions", {"stream_options": 0}),
    ("stream_options []", "/v1/completions", {"stream_options": []}),
    ("stream_options without stream", "/v1/completions", {"stream_options": {"include_usage": True}}),
    ("logit_bias 1_0", "/v1/completions", {"logit_bias": {"1_0": 5}}),
]:
    r = post(path, {**(chat if "chat" in path else base), **extra})
    check(f"{name} 400", r.status_code == 400, f"{r.status_code} {r.text[:90]}")
r = c.post(
    "/v1/completions",
    content=b'{"model": "demo", "prompt": "a", "prompt": "b", "max_tokens": 2}',
    headers={"Content-Type": "application/json"},
)
check("duplicate keys 400", r.status_code == 400, f"{r.status_code} {r.text[:80]}")
r = post("/v1/chat/completions", {**chat, "messages": [{"role": "user<|im_end|>", "content": "x"}]})
check("special-token role 400", r.status_code == 400, f"{r.status_code} {r.text[:80]}")
r = post("/v1/completions", {**base, "temperature": 1.0, "top_p": 1e-300})
check("top_p 1e-300 not 500", r.status_code == 200, f"{r.status_code}")
# connection cap: open more connections than --max-connections, each sending a request
socks = []
for _ in range(6):
    s = socket.create_connection((HOST, PORT))
    socks.append(s)
answers = []
for s in socks:
    s.settimeout(10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
for s in socks:
    try:
        answers.append(s.recv(200).split(b"\r\n")[0])
    except TimeoutError:
        answers.append(b"timeout")
    s.close()
check("connection cap refuses with 503", any(a.startswith(b"HTTP/1.1 503") for a in answers), str(answers))
r = c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
check(
    "OpenMetrics on request",
    "openmetrics" in r.headers.get("content-type", ""),
    r.headers.get("content-type", ""),
)
r = post("/v1/completions", {**base, "logprobs": 1, "temperature": 0})
check("text_offset", "text_offset" in r.json()["choices"][0]["logprobs"], "")
print(f"\n{sum(ok for _, ok, _ in results)} of {len(results)} probe classes hold")
