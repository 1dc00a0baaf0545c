"""`make serve`: start the server on the embedded default model, wait for its ready line, send
one sample chat request, print the answer, and stop the server cleanly (SIGTERM).

Options after `python -m lmserver.edge.main_job` are passed to `lmserver serve` (e.g. `--model-path`).
"""

from __future__ import annotations

import sys
import time

import httpx

from lmserver.edge.server_process import ServerProcess

QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print(f"starting: lmserver serve {' '.join(args)}".rstrip(), flush=True)
    t0 = time.monotonic()
    server = ServerProcess(args, core=None)
    try:
        server.start(timeout_s=1800)
    except RuntimeError as exc:
        print(f"the server failed to start:\n{exc}", file=sys.stderr)
        return 1
    try:
        print(f"server ready at {server.base_url} after {time.monotonic() - t0:.1f} s", flush=True)
        body = {"model": "default", "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 64, "temperature": 0}
        t1 = time.monotonic()
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
        if r.status_code != 200:
            print(f"request failed ({r.status_code}): {r.text}", file=sys.stderr)
            return 1
        out = r.json()
        print(f"Q: {QUESTION}")
        print(f"A: {out['choices'][0]['message']['content'].strip()}")
        print(f"({out['usage']['completion_tokens']} tokens in {time.monotonic() - t1:.2f} s)", flush=True)
    finally:
        code = server.stop()
    print(f"server stopped (exit status {code})")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
