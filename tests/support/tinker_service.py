"""The Tinker service (`rollout tinker-serve`) on a tiny saved model, run by uvicorn on a thread of the test
process on 127.0.0.1 (bounded start, stopped at the end), and the `tinker` SDK's client on it."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

KEY = "tml-test-key"


@dataclass
class TinkerServed:
    url: str
    service: object
    model_dir: Path

    def client(self):
        import tinker

        return tinker.ServiceClient(base_url=self.url, api_key=KEY)


@contextlib.contextmanager
def tinker_serving(model_dir: Path, checkpoint_dir: Path, start_timeout: float = 60.0, **kwargs):
    """Run the service on `model_dir` (a `save_tiny` directory); `kwargs` go to `build_service`."""
    import uvicorn

    from rollout.tinker.app import build_app
    from rollout.tinker.cli import build_service, load

    from .serving import free_port

    model, tokenizer, gc = load(str(model_dir), "float32")
    service = build_service(
        model, tokenizer, gc, str(model_dir), checkpoint_dir, **{"num_blocks": 256, "poll_s": 2.0, **kwargs}
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(service, KEY), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="uvicorn-tinker", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the tinker test server did not start")
            time.sleep(0.02)
        yield TinkerServed(f"http://127.0.0.1:{port}", service, model_dir)
    finally:
        server.should_exit = True
        thread.join(30)
        service.close()
        service.engine.close()
