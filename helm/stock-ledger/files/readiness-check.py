"""helm test, step 1: wait until WORKERS_EXPECTED workers answer /readyz with 200.

The workers are found through the DNS name of the chart's headless Service (WORKERS_HOST, one address per pod,
NotReady ones included), so the test pod needs no Kubernetes API access. Runs with the app image's Python
(`python -c`); prints one progress line per round; exits 1 with the last answers after READY_TIMEOUT_SECONDS.
"""

import os
import socket
import sys
import time
import urllib.error
import urllib.request

host = os.environ["WORKERS_HOST"]
port = int(os.environ["WORKERS_PORT"])
expected = int(os.environ["WORKERS_EXPECTED"])
deadline = time.monotonic() + float(os.environ.get("READY_TIMEOUT_SECONDS", "300"))


def addresses():
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)})
    except OSError:
        return []


def readyz(address):
    url = f"http://[{address}]:{port}/readyz" if ":" in address else f"http://{address}:{port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status, response.read(200).decode(errors="replace").strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read(200).decode(errors="replace").strip()
    except OSError as error:
        return None, str(error)


while True:
    answers = {address: readyz(address) for address in addresses()}
    ready = [address for address, (status, _) in answers.items() if status == 200]
    print(f"readiness: {len(ready)}/{expected} workers ready ({len(answers)} found at {host})", flush=True)
    if len(ready) >= expected:
        sys.exit(0)
    if time.monotonic() > deadline:
        for address, (status, body) in sorted(answers.items()):
            print(f"  {address}: {status} {body}", flush=True)
        sys.exit(f"readiness: only {len(ready)} of {expected} workers Ready at {host}:{port} in time; "
                 "see `kubectl describe pod` and the worker logs")
    time.sleep(5)
