"""sim/vllm_engines.py's launcher, on a stand-in for ``vllm serve`` (no vLLM needed): a port some
other process took between picking and binding is picked again, even when the engine's traceback
for it is far above the end of its log (vLLM's EngineCore fails first, the API server's own
traceback follows)."""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

from sim.vllm_engines import VllmEngine

STAND_IN = textwrap.dedent(
    """
    import http.server, socket, sys
    port, events = int(sys.argv[1]), int(sys.argv[2])
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", events))
    except OSError:
        print(f"zmq.error.ZMQError: Address already in use (addr='tcp://*:{events}')", flush=True)
        for i in range(80):
            print(f"  File 'core_client.py', line {i}, in __init__", flush=True)
        print("RuntimeError: Engine core initialization failed.", flush=True)
        sys.exit(1)
    probe.close()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


class StandIn(VllmEngine):
    """The launcher as it is, with the stand-in as the command."""

    script: Path

    def command(self) -> list[str]:
        return [sys.executable, str(self.script), str(self.port), str(self.events_port)]


def test_a_taken_port_buried_in_the_log_is_picked_again(tmp_path: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        engine = StandIn(tmp_path / "model", tmp_path / "log", core=0)
        engine.script = tmp_path / "serve.py"
        engine.script.write_text(STAND_IN)
        taken = held.getsockname()[1]
        engine.events_port = taken
        first_log = engine.log_path  # (named by the port: a new launch logs elsewhere)
        try:
            engine.start()
            assert len(engine.starts) == 1 and engine.events_port != taken
            assert "Address already in use" in first_log.read_text()
            assert "Address already in use" not in engine.log_path.read_text()
        finally:
            engine.stop()
    finally:
        held.close()
