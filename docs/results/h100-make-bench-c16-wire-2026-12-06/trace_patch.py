# ruff: noqa: E501, E701, E702 (a measurement's script, kept as it ran)
"""Timestamps along a request's path to its first token (an experiment, applied to a copy)."""

open("reference_engine/_trace.py", "w").write("""import os, time
_fd = os.open(f"/tmp/trace-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
_seen = set()
def T(tag, rid=""):
    os.write(_fd, f"{time.monotonic():.6f} {tag} {rid}\\n".encode())
def first(tag, rid):
    key = (tag, rid)
    if key not in _seen:
        _seen.add(key)
        T(tag, rid)
""")


def edit(path, pairs):
    s = open(path).read()
    for old, new in pairs:
        assert s.count(old) == 1, (path, old)
        s = s.replace(old, new)
    open(path, "w").write(s)


edit(
    "reference_engine/serving/async_engine.py",
    [
        (
            '        self._send(("add", request_id, prompt_ids, params))',
            '        from .. import _trace; _trace.T("H_submit", request_id)\n        self._send(("add", request_id, prompt_ids, params))',
        ),
        (
            "                self.known.add(request_id)",
            '                from .. import _trace; _trace.T("E_add", request_id)\n                self.known.add(request_id)',
        ),
        (
            "        outputs = self.engine.step()",
            '        from .. import _trace; _trace.T("E_step0", len(self.engine.scheduler.active))\n        outputs = self.engine.step()\n        _trace.T("E_step1", len(outputs))\n        for o in outputs:\n            _trace.first("E_first_out", o.request_id)',
        ),
        (
            '            if kind == "out":',
            '            from .. import _trace\n            if kind == "out":\n                _trace.first("H_first_out", event[1].request_id)',
        ),
    ],
)
edit(
    "reference_engine/runtime/scheduler.py",
    [
        (
            "            seq.phase = Phase.PREFILL",
            '            seq.phase = Phase.PREFILL\n            from .. import _trace; _trace.T("E_admit", seq.request_id)',
        ),
    ],
)
edit(
    "reference_engine/serving/generation.py",
    [
        (
            "        request_id = server.new_request_id(parsed.chat)",
            '        request_id = server.new_request_id(parsed.chat)\n        from .. import _trace; _trace.T("H_arrive", f"{request_id} {arrival_s:.6f}")',
        ),
        (
            "        return cls(server, request_id, parsed, queue, counted)",
            '        _trace.T("H_added", request_id)\n        return cls(server, request_id, parsed, queue, counted)',
        ),
        (
            "            item = await self.queue.get()",
            '            item = await self.queue.get()\n            from .. import _trace; _trace.first("H_first_get", self.request_id)',
        ),
    ],
)
edit(
    "reference_engine/serving/async_engine.py",
    [
        (
            "            if out.finished:",
            '            if out.finished:\n                _trace.T("E_last", out.request_id)',
        ),
        (
            '            if kind == "out":\n                _trace.first("H_first_out", event[1].request_id)',
            '            if kind == "out":\n                _trace.first("H_first_out", event[1].request_id)\n                if event[1].finished:\n                    _trace.T("H_last_out", event[1].request_id)',
        ),
    ],
)
edit(
    "reference_engine/serving/replies.py",
    [
        (
            '    yield "data: [DONE]\\n\\n"',
            '    from .. import _trace; _trace.T("H_done", request_id)\n    yield "data: [DONE]\\n\\n"',
        ),
        (
            "            self.close()",
            '            self.close()\n            from .. import _trace; _trace.T("H_closed", getattr(self, "_rid", ""))',
        ),
    ],
)
edit(
    "harness/client.py",
    [
        (
            "    sent = time.perf_counter()\n",
            '    sent = time.perf_counter()\n    from reference_engine import _trace; _trace.T("C_send", index)\n',
        ),
        (
            "                if reader.feed_bytes(piece, time.perf_counter() - sent):\n",
            '                if reader.feed_bytes(piece, time.perf_counter() - sent):\n                    _trace.T("C_done", index)\n',
        ),
        (
            "                    await drain(pieces)  # the connection goes back to the pool\n",
            '                    await drain(pieces)  # the connection goes back to the pool\n                    _trace.T("C_drained", index)\n',
        ),
    ],
)
print("patched")
