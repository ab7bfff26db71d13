"""SIGTERM ends every subcommand promptly with 143 (the container tests check the same as PID 1)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def test_sigterm_stops_a_subcommand_waiting_on_a_silent_broker() -> None:
    """1. `create-topic` against a port that accepts and never answers (it would wait for its timeouts);
    2. SIGTERM after start-up; 3. it exits 143 within seconds and says why."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")},
               "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{silent.getsockname()[1]}", "STOCK_LEDGER_LOG_FORMAT": "json"}
        proc = subprocess.Popen([sys.executable, "-m", "stock_ledger", "create-topic"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        assert proc.poll() is None, proc.communicate()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert time.monotonic() - started < 5
    assert "stopped by SIGTERM" in err
